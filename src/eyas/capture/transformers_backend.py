"""In-process capture with transformers: forward hooks on the aux decoder layers only.

Per batch (a token budget of padded tokens, sequences sorted by length so padding stays small):
1. one forward pass of the target's base model (no ``lm_head``, no KV cache);
2. a hook on each aux decoder layer copies only the real tokens' rows of its output into one packed buffer
   ``aux`` [N, L, H] (N = real tokens in the batch) in the store dtype, so the whole ``output_hidden_states``
   tuple (N+1 full activations at long context) is never kept; the post-norm ``last_hidden_state`` is packed the
   same way into ``last`` [N, H];
3. optionally fp8 quantisation of ``aux`` on the device (:mod:`eyas.store.fp8`), halving the copy;
4. one asynchronous device-to-host copy per tensor into pinned memory; while it runs and the caller stores the
   previous batch, the next batch's forward pass is already queued (one batch of look-ahead).

Equal to transformers' own ``output_hidden_states[i + 1]`` for ``output_of_layer`` id i, and to
``last_hidden_state`` (= ``output_hidden_states[-1]``, after the final norm) for the last state
(transformers ``models/llama/modeling_llama.py``: ``LlamaModel.forward``).

A target larger than one GPU is spread with ``extract.device_map: auto`` (accelerate); data parallelism over GPUs
is the extract stage's (one replica per torchrun rank).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ..batching import token_budget_batches
from ..dtypes import DTYPES
from ..records import TokenizedSample
from ..store.fp8 import quantize_fp8
from ..store.labels import CompactLabels
from . import CapturedSample


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack without ``lm_head``: ``model.model`` of a ``*ForCausalLM``, else the model itself."""
    inner = getattr(model, "model", None)
    return inner if inner is not None and hasattr(inner, "layers") else model


def _decoder_layers(model) -> torch.nn.ModuleList:
    layers = getattr(_base_model(model), "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: cannot find its decoder layers (expected model.model.layers)")
    return layers


@dataclass
class _InFlight:
    """A launched batch: its samples, offsets into the packed tensors, and the (possibly still copying) tensors."""

    samples: list[TokenizedSample]
    offsets: list[int]
    ids: torch.Tensor                 # int32 [N] (CPU)
    tensors: dict[str, torch.Tensor]  # aux [N, L, H], last [N, H], finite [1], aux_scale [N, L] (CPU, maybe pinned)
    events: list


class TransformersBackend:
    """Capture aux hidden states at ``layer_ids`` (``output_of_layer``, 0-based) and the post-norm last state.

    ``model``: a transformers causal LM or its base model, eval mode, on one device or spread by ``device_map``.
    ``store_dtype``: dtype of the yielded ``aux``/``last`` (cast on the device); ``aux_format``
    ``"float8_e4m3fn"`` quantises ``aux`` on the device and yields ``aux_scale``. Implements
    :class:`eyas.capture.CaptureBackend`.
    """

    def __init__(self, model: torch.nn.Module, layer_ids: list[int], *, batch_tokens: int,
                 store_dtype: torch.dtype, aux_format: str = "same", engine: dict | None = None):
        import transformers

        self.model = _base_model(model)
        self.layer_ids = list(layer_ids)
        self.batch_tokens = batch_tokens
        self.store_dtype = store_dtype
        self.fp8 = aux_format == "float8_e4m3fn"
        # set by extraction for a top-k store (eyas.store.labels.LabelMaker on this backend's device): the labels
        # are made from the last state where it is, and replace it in what is copied to the host
        self.labeler = None
        self.hidden_size = int(self.model.config.hidden_size)
        self.input_device = self.model.get_input_embeddings().weight.device
        self.engine = engine or {"name": "transformers", "version": transformers.__version__}
        self._aux: torch.Tensor | None = None          # [N, L, H] packed buffer of the batch being computed
        self._full: dict[int, torch.Tensor] | None = None  # capture_padded: aux layer j -> its output [B, T, H]
        self._idx: dict[torch.device, torch.Tensor] = {}  # flat indices of real tokens, per device
        layers = _decoder_layers(model)
        self._hooks = [layers[i].register_forward_hook(self._hook(j)) for j, i in enumerate(self.layer_ids)]

    def _index_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._idx:
            self._idx[device] = next(iter(self._idx.values())).to(device, non_blocking=True)
        return self._idx[device]

    def _hook(self, j: int):
        def fn(_module, _inputs, output):
            h = output[0] if isinstance(output, tuple) else output  # [B, T, H]
            if self._full is not None:
                self._full[j] = h
            if self._aux is None:  # the model runs outside capture(): not ours to store
                return
            self._aux[:, j].copy_(h.reshape(-1, self.hidden_size).index_select(0, self._index_on(h.device)))
        return fn

    @torch.no_grad()
    def _launch(self, batch: list[TokenizedSample]) -> _InFlight:
        B, T = len(batch), max(s.num_tokens for s in batch)
        ids = torch.zeros(B, T, dtype=torch.long)
        mask = torch.zeros(B, T, dtype=torch.long)
        flat, offsets, n = [], [], 0
        for r, s in enumerate(batch):
            ids[r, : s.num_tokens] = torch.tensor(s.input_ids, dtype=torch.long)
            mask[r, : s.num_tokens] = 1
            flat.append(torch.arange(r * T, r * T + s.num_tokens))
            offsets.append(n)
            n += s.num_tokens
        offsets.append(n)
        flat_idx = torch.cat(flat)                                           # [N]
        dev = self.input_device
        self._idx = {dev: flat_idx.to(dev, non_blocking=True)}
        self._aux = torch.empty(n, len(self.layer_ids), self.hidden_size, dtype=self.store_dtype, device=dev)
        out = self.model(input_ids=ids.to(dev, non_blocking=True), attention_mask=mask.to(dev, non_blocking=True),
                         use_cache=False)
        hl = out.last_hidden_state                                           # [B, T, H], post-norm
        last = hl.reshape(-1, self.hidden_size).index_select(0, self._index_on(hl.device)).to(self.store_dtype)
        # one flag per batch, computed where the states are (free on a GPU); a False makes the writer check each
        # sample itself and name the bad one
        finite = (torch.isfinite(self._aux).all() & torch.isfinite(last).all().to(self._aux.device)).reshape(1)
        tensors = {"last": last, "finite": finite}
        if self.labeler is not None:   # a top-k store: labels made here, only they leave the device
            lab = self.labeler(last)
            tensors = {"label_ids": lab.ids, "label_probs": lab.probs, "label_flags": lab.flags, "finite": finite}
        if self.fp8:
            tensors["aux"], tensors["aux_scale"] = quantize_fp8(self._aux)
        else:
            tensors["aux"] = self._aux
        self._aux = None
        events = []
        for k, t in list(tensors.items()):
            if t.device.type == "cuda":  # asynchronous copy into pinned memory, waited for in _finish
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(t.device))
                events.append(ev)
                tensors[k] = host
        return _InFlight(batch, offsets, ids[mask.bool()].to(torch.int32), tensors, events)

    @torch.no_grad()
    def capture_padded(self, input_ids: torch.Tensor, attention_mask: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """States of a padded batch, left on the device (online training: nothing goes through the host).

        ``input_ids``, ``attention_mask`` int [B, T] (right-padded). Returns ``aux`` [B, T, L, H] and ``last``
        [B, T, H] in the store dtype, exactly what :meth:`capture` would store for the real rows (an fp8 store's
        aux are quantised and de-quantised, as a reader of the store gets them back); padded rows are zero."""
        from ..store.fp8 import dequantize_fp8

        dev = self.input_device
        self._full = {}
        try:
            mask = attention_mask.to(dev)
            out = self.model(input_ids=input_ids.to(dev), attention_mask=mask, use_cache=False)
            aux = torch.stack([self._full[j].to(dev) for j in range(len(self.layer_ids))], dim=2)  # [B,T,L,H]
        finally:
            self._full = None
        keep = mask.bool().unsqueeze(-1)
        aux = aux.to(self.store_dtype)
        if self.fp8:
            B, T, L, H = aux.shape
            q, scale = quantize_fp8(aux.reshape(B * T, L, H))
            aux = dequantize_fp8(q, scale, self.store_dtype).view(B, T, L, H)
        last = out.last_hidden_state.to(self.store_dtype)
        return torch.where(keep.unsqueeze(-1), aux, 0), torch.where(keep, last, 0)

    @staticmethod
    def _finish(f: _InFlight) -> Iterator[CapturedSample]:
        for ev in f.events:
            ev.synchronize()
        finite = bool(f.tensors["finite"][0])
        for r, s in enumerate(f.samples):
            a, b = f.offsets[r], f.offsets[r + 1]
            sc = f.tensors.get("aux_scale")
            t = f.tensors
            labels = (CompactLabels(t["label_ids"][a:b], t["label_probs"][a:b], t["label_flags"][a:b])
                      if "label_ids" in t else None)
            yield CapturedSample(s.id, f.ids[a:b], t["aux"][a:b], t["last"][a:b] if labels is None else None,
                                 None if sc is None else sc[a:b], finite, labels)

    def capture(self, samples: Sequence[TokenizedSample]) -> Iterator[CapturedSample]:
        """Yield each sample's states (CPU), batch by batch; see :class:`eyas.capture.CaptureBackend`.

        Batches: :func:`token_budget_batches` over ``samples`` in the given order (``extract.batch_tokens``).
        """
        pending: _InFlight | None = None
        for idx in token_budget_batches([s.num_tokens for s in samples], self.batch_tokens):
            launched = self._launch([samples[i] for i in idx])
            if pending is not None:
                yield from self._finish(pending)
            pending = launched
        if pending is not None:
            yield from self._finish(pending)

    def close(self) -> None:
        """Remove the hooks (the model is left as it was)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def resolve_compute_dtype(extract_cfg, target_cfg, device: torch.device) -> str:
    """``extract.compute_dtype``; ``auto`` is bfloat16 on a GPU and ``target.dtype`` elsewhere."""
    if extract_cfg.compute_dtype != "auto":
        return extract_cfg.compute_dtype
    return "bfloat16" if device.type == "cuda" else target_cfg.dtype


def make_backend(target_cfg, extract_cfg, layer_ids: list[int], device: str | None) -> TransformersBackend:
    """Load the target's base model (no ``lm_head``) for capture, on ``device`` (default ``target.device``) or
    spread over the GPUs with ``extract.device_map``, and wrap it in a :class:`TransformersBackend`."""
    from transformers import AutoModel

    from ..targets.load import materialize_target, resolve_device

    path = materialize_target(target_cfg)
    dev = resolve_device(device or target_cfg.device)
    compute = resolve_compute_dtype(extract_cfg, target_cfg, dev)
    kwargs = dict(dtype=DTYPES[compute], trust_remote_code=target_cfg.trust_remote_code)
    if extract_cfg.device_map:
        model = AutoModel.from_pretrained(path, device_map=extract_cfg.device_map, **kwargs)
    else:
        model = AutoModel.from_pretrained(path, **kwargs).to(dev)
    model.eval().requires_grad_(False)
    return TransformersBackend(model, layer_ids, batch_tokens=extract_cfg.batch_tokens,
                               store_dtype=DTYPES[extract_cfg.dtype], aux_format=extract_cfg.aux_format,
                               engine=engine_info(target_cfg, extract_cfg, dev))


def engine_info(target_cfg, extract_cfg, device: torch.device | None = None) -> dict:
    """Engine identity for the store header: transformers and torch versions, compute dtype, device map."""
    import transformers

    from ..targets.load import resolve_device

    dev = device or resolve_device(target_cfg.device)
    return {"name": "transformers", "version": transformers.__version__, "torch": torch.__version__,
            "compute_dtype": resolve_compute_dtype(extract_cfg, target_cfg, dev),
            "device_map": extract_cfg.device_map}

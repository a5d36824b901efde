"""train: the EAGLE-3 draft with training-time test, offline from the store or online from the target.

The draft vocabulary and layer ids are read from the run (vocab stage, store header), never recomputed; with
``--init-from DRAFTER`` (``train.init_from``) the drafter's own d2t/t2d are kept. ``train.mode: online`` runs the
target in this job to make each batch's states (rounded to ``extract.dtype``, as the store would hold them, so
offline and online train on the same numbers). Under ``torchrun`` every process runs this stage; process 0
writes. Writes ``train/checkpoints/step-*/``, ``train/metrics.jsonl``, ``train/tensorboard/`` and
``train/final/`` (``draft.safetensors`` + ``draft_config.json``), from which export builds the engine folders.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..data.vocab import load_vocab
from ..dtypes import DTYPES
from ..errors import EyasError
from ..io import read_json, write_json_atomic
from ..records import read_tokenized
from ..store import HiddenStateStore
from ..store.header import expected_header
from ..summaries import TrainSummary
from ..targets.load import load_target_head, read_target_config, resolve_device
from ..train.build import build_draft, draft_config_for
from ..train.data import StoreDataset, TokenDataset, split_held_out
from ..train.loop import StateSource, stored_states, train
from ..train.metrics import summarise_metrics
from . import RunContext

# extract: online training captures with the extract stage's backend and dtypes; the store header names its layers
READS = ("train", "target", "extract")
INPUTS = ("tokenize", "vocab", "extract")


class _Subset:
    """A view of a dataset restricted to some indices (held-out split)."""

    def __init__(self, ds, idx: list[int]):
        self.ds, self.idx = ds, idx

    def __len__(self) -> int:
        return len(self.idx)

    def num_tokens(self, i: int) -> int:
        return self.ds.num_tokens(self.idx[i])

    def __getitem__(self, i: int) -> dict:
        return self.ds[self.idx[i]]


def online_states(ctx: RunContext, layer_ids: list[int], samples: list) -> StateSource:
    """The target, loaded in this job through the extract stage's own capture backend (``extract.backend``,
    compute and storage dtypes as extract would use), captures each batch's aux and post-norm last states;
    nothing is stored. So offline and online train on the same numbers."""
    from ..capture import make_backend
    from ..store.fp8 import dequantize_fp8

    backend = make_backend(ctx.cfg.extract.backend, ctx.cfg.target, ctx.cfg.extract, layer_ids, None)
    by_id = {s.id: s for s in samples}
    dt = DTYPES[ctx.cfg.extract.dtype]

    def states(batch: dict, device: torch.device) -> dict:
        got = {c.sample_id: c for c in backend.capture([by_id[i] for i in batch["ids"]])}
        B, T = batch["input_ids"].shape
        aux = last = None
        for r, sid in enumerate(batch["ids"]):
            c = got[sid]
            a = dequantize_fp8(c.aux, c.aux_scale, dt) if c.aux_scale is not None else c.aux   # [T, L, Ht]
            n = int(batch["attention_mask"][r].sum())           # the sample, cut to train.max_length
            if aux is None:
                aux = torch.zeros(B, T, a.shape[1] * a.shape[2], dtype=a.dtype)
                last = torch.zeros(B, T, c.last.shape[-1], dtype=c.last.dtype)
            aux[r, :n] = a[:n].reshape(n, -1)
            last[r, :n] = c.last[:n]
        return {**batch, "aux": aux.to(device), "last": last.to(device)}

    return states


def _as_float(source: StateSource, dtype: torch.dtype) -> StateSource:
    def states(batch: dict, device: torch.device) -> dict:
        b = source(batch, device)
        return {**b, "aux": b["aux"].to(dtype), "last": b["last"].to(dtype)}
    return states


def load_drafter(folder: Path, embed: torch.Tensor):
    """An existing drafter to fine-tune: an Eyas ``train/final`` folder (``draft_config.json``) or an SGLang
    folder (``config.json`` with ``LlamaForCausalLMEagle3``). Returns (model, aux layer ids or None).
    Raises :class:`EyasError` when the folder is neither."""
    from safetensors.torch import load_file

    from ..model.eagle3 import Eagle3Config, Eagle3DraftModel

    if (folder / "draft_config.json").exists():
        meta = read_json(folder / "draft_config.json")
        model = Eagle3DraftModel(Eagle3Config(**meta["draft"]))
        missing, unexpected = model.load_state_dict(load_file(str(folder / "draft.safetensors")), strict=False)
        bad = [k for k in missing if not k.startswith(("embed_tokens.", "rotary."))]
        if bad or unexpected:
            raise EyasError(f"{folder}: draft weights do not match: missing {bad}, unexpected {unexpected}")
        if model.config.hidden_size == model.config.target_hidden_size:   # else it saved its own table
            with torch.no_grad():
                model.embed_tokens.weight.copy_(embed)
        return model, meta.get("aux_layer_ids")
    if (folder / "config.json").exists():
        from ..export.sglang import load_sglang_draft

        return load_sglang_draft(folder, embed)
    raise EyasError(f"train.init_from: {folder} has neither draft_config.json (Eyas) nor config.json (SGLang)")


def run(ctx: RunContext) -> TrainSummary:
    cfg = ctx.cfg.train
    out = ctx.run.stage("train")
    target_cfg = read_target_config(ctx.cfg.target)
    embed, lm_head = load_target_head(ctx.cfg.target)
    samples = read_tokenized(ctx.run.tokenized)
    if cfg.mode == "offline":
        store = HiddenStateStore.open(ctx.run.store)
        header = store.header
        dataset = StoreDataset(samples, store, cfg.max_length)
        states = stored_states
    else:
        header = expected_header(ctx.cfg.target, ctx.cfg.extract, ctx.run)
        dataset = TokenDataset(samples, cfg.max_length)
        states = online_states(ctx, header.layer_ids, samples)
    states = _as_float(states, torch.bfloat16 if cfg.autocast == "bfloat16" else torch.float32)
    layer_ids = header.layer_ids
    if cfg.init_from:
        model, their_layers = load_drafter(Path(cfg.init_from).expanduser(), embed)
        dcfg = model.config
        if their_layers is not None and list(their_layers) != list(layer_ids):
            raise EyasError(f"train.init_from: {cfg.init_from} was trained on aux layers {their_layers}, this run "
                            f"captures {layer_ids} ({header.layer_convention}); they must match")
        if dcfg.vocab_size != int(embed.shape[0]) or dcfg.target_hidden_size != int(embed.shape[1]):
            raise EyasError(f"train.init_from: {cfg.init_from} was made for a target of vocabulary "
                            f"{dcfg.vocab_size} / hidden {dcfg.target_hidden_size}, this target has "
                            f"{embed.shape[0]} / {embed.shape[1]}")
        ctx.log(f"[eyas] train: fine-tuning {cfg.init_from} (its draft vocabulary of {dcfg.draft_vocab_size} "
                f"kept; the run's vocab stage is not used)")
    else:
        d2t, t2d = load_vocab(ctx.run.vocab)
        dcfg = draft_config_for(target_cfg, cfg.draft, len(d2t), len(layer_ids))
        model = build_draft(dcfg, embed, d2t, t2d, cfg.seed)
    train_idx, held_idx = split_held_out(len(dataset), min(cfg.eval_samples, len(dataset) - 1), cfg.seed)
    train_set, held_out = _Subset(dataset, train_idx), (_Subset(dataset, held_idx) if held_idx else None)
    device = resolve_device(cfg.device)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ctx.log(f"[eyas] train ({cfg.mode}): {len(train_set)} samples ({len(held_idx)} held out), draft "
            f"{n_params / 1e6:.1f}M trainable parameters, TTT {cfg.ttt_steps} steps, device {device}")
    result = train(model, train_set, lm_head, cfg, out, device, ctx.fingerprint, log=ctx.log,
                   states=states, held_out=held_out)
    import torch.distributed as tdist

    summary = _write_final(ctx, result, dcfg, layer_ids, header, n_params) if result.final_state else None
    if tdist.is_initialized():  # every process returns process 0's summary (each writes the same done.json)
        box = [summary]
        tdist.broadcast_object_list(box, src=0)
        summary = box[0]
    return summary


def _write_final(ctx: RunContext, result, dcfg, layer_ids, header, n_params: int) -> TrainSummary:
    """``train/final`` (weights + draft_config.json) and the stage summary; process 0 only."""
    from safetensors.torch import save_file

    cfg = ctx.cfg.train
    final = ctx.run.drafter
    final.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in result.final_state.items()},
              str(final / "draft.safetensors"))
    write_json_atomic(final / "draft_config.json", {
        "draft": dcfg.to_dict(), "aux_layer_ids": layer_ids,
        "layer_convention": header.layer_convention, "target": header.target,
        "ttt_steps": cfg.ttt_steps,
    })
    summary = summarise_metrics(ctx.run.train_metrics, cfg.ttt_steps)
    summary.update(trainable_parameters=n_params, steps=result.steps, mode=cfg.mode,
                   tokens_per_s=round(result.final_metrics.get("tokens_per_s", 0.0), 1))
    return TrainSummary(**summary)


def load_trained_draft(ctx: RunContext, device: torch.device):
    """The trained draft of this run (from ``train/final``), with the target's embedding table, in eval mode."""
    from safetensors.torch import load_file

    from ..model.eagle3 import Eagle3Config, Eagle3DraftModel

    final = ctx.run.drafter
    meta = read_json(final / "draft_config.json")
    model = Eagle3DraftModel(Eagle3Config(**meta["draft"]))
    embed, _ = load_target_head(ctx.cfg.target)
    state = load_file(str(final / "draft.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    bad = [k for k in missing if not k.startswith(("embed_tokens.", "rotary."))]
    if bad or unexpected:
        raise RuntimeError(f"draft weights do not match the model: missing {bad}, unexpected {unexpected}")
    if not model.config.own_embedding:  # a draft of another width saved its own table with its weights
        with torch.no_grad():
            model.embed_tokens.weight.copy_(embed)
    return model.to(device).eval(), meta

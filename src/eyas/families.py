"""Per-family facts as data: which target layers feed the drafter, the two layer-id conventions, and what the
draft config takes from each family's target config.

Conventions (FIELD_NOTES "Which target layers"): both name the same physical states, the outputs of 0-based
decoder layers ``1, N//2-1, N-4``:
- ``output_of_layer``: the 0-based decoder layer whose output is captured. SGLang draft config
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` and SpecForge use it: ``[1, N//2-1, N-4]``.
- ``hf_index``: the index into Hugging Face ``output_hidden_states`` (0 = embeddings), i.e. the residual stream
  after L layers. vLLM's top-level ``eagle_aux_hidden_state_layer_ids``, speculators, EAGLE and ModelOpt use it:
  ``[2, N//2, N-3]``.
Eyas stores ``output_of_layer`` everywhere and converts only at an engine boundary.

Families (:data:`FAMILIES`): one :class:`Family` record each, found from a target's ``config.json`` by
:func:`family_of` (``model_type`` first, then ``architectures``). What the records say about the engines was read
from the engines' own model files:
- vLLM 0.32 (``vllm/model_executor/models/interfaces.py`` ``get_eagle3_default_aux_hidden_state_layers``: every
  model that implements ``SupportsEagle3`` defaults to hf_index ``(2, N//2, N-3)``; ``deepseek_v2.py`` (DeepSeek-V3,
  Kimi-K2) overrides it with the same tuple). ``Gemma3ForCausalLM`` in ``gemma3.py`` does not implement
  ``SupportsEagle3``, so vLLM 0.32 cannot serve an EAGLE-3 drafter for Gemma 3.
- SGLang (``python/sglang/srt/models/{llama,qwen3,qwen3_moe,deepseek_v2,gpt_oss,gemma3_causal}.py``
  ``set_eagle3_layers_to_capture``): default ``[2, N//2, N-3]`` captured as layer inputs, i.e. hf_index; ids from the
  draft's ``eagle_config`` get ``+1`` (they are output_of_layer).
So every family here uses the same default, ``output_of_layer [1, N//2-1, N-4]``; the records keep the rule per
family so that a family with another default is a one-line change, not a branch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

from .errors import ConfigError

Convention = Literal["output_of_layer", "hf_index"]
STORE_CONVENTION: Convention = "output_of_layer"


def engine_default_aux_layer_ids(num_layers: int) -> list[int]:
    """The engines' default ``[1, N//2-1, N-4]`` in the ``output_of_layer`` convention (hf_index ``[2, N//2, N-3]``)."""
    return [1, num_layers // 2 - 1, num_layers - 4]


@dataclass(frozen=True)
class Family:
    """What Eyas needs to know about one target family, as data.

    Fields:
        name: short key (``"deepseek_v3"``); ``title``: how people call it.
        model_types / architectures: ``config.json`` values that identify the family.
        transformers_class: the transformers class that runs the target (and builds the tiny test targets).
        attention: ``"gqa"``, ``"mla"`` (DeepSeek multi-head latent attention), ``"gqa+sinks"`` (gpt-oss), with
            ``sliding`` noted where some layers use a sliding window.
        moe: routed experts in (most) decoder layers.
        aux_layers: ``N -> output_of_layer ids`` the engines use by default for this family.
        aux_layers_source: the engine files the rule was read from.
        draft_head_dim_key: the target config key whose value is the draft's ``head_dim``; MLA targets have no
            plain head dim (q/k are ``qk_nope + qk_rope`` = 192 wide, v is ``v_head_dim`` = 128), so the draft,
            a plain GQA layer, takes ``v_head_dim`` (TorchSpec's Kimi-K2.5 draft: 64 heads x 128).
        rope_layer_type: targets whose ``rope_parameters`` are nested per layer type (Gemma 3: sliding layers use
            theta 1e4, full layers 1e6 and the long-context scaling) give the draft the RoPE of this layer type.
        embedding_multiplier: ``"sqrt_hidden"`` when the target scales its token embeddings in its forward pass
            (Gemma); the draft, like SGLang's, reads the raw ``embed_tokens`` table.
        end_of_turn: special tokens that end an assistant turn in the served chat template (trained tokens).
        role_tokens: the template's role markers (never trained).
        vllm_eagle3: vLLM 0.32 implements ``SupportsEagle3`` for this target class.
        sglang_eagle3: SGLang's model file has ``set_eagle3_layers_to_capture``.
        reference: published ``config.json`` shapes of the family's best-known checkpoints (the fields Eyas reads),
            used by ``eyas plan`` examples and scaled down for the tests' tiny targets.
        notes: what else to know when training a drafter for this family.
    """

    name: str
    title: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    transformers_class: str
    attention: str
    moe: bool
    aux_layers: Callable[[int], list[int]] = engine_default_aux_layer_ids
    aux_layers_source: str = ""
    draft_head_dim_key: str = "head_dim"
    rope_layer_type: str | None = None
    embedding_multiplier: str | None = None
    end_of_turn: tuple[str, ...] = ()
    role_tokens: tuple[str, ...] = ()
    vllm_eagle3: bool = True
    sglang_eagle3: bool = True
    reference: dict[str, dict] = field(default_factory=dict)
    notes: str = ""


_VLLM_DEFAULT = "vllm/model_executor/models/interfaces.py (vLLM 0.32): (2, N//2, N-3) hf_index"
_SGL_DEFAULT = "set_eagle3_layers_to_capture: [2, N//2, N-3] layer inputs (= hf_index)"

FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family(
        name="llama3", title="Llama 3", model_types=("llama",), architectures=("LlamaForCausalLM",),
        transformers_class="LlamaForCausalLM", attention="gqa", moe=False,
        aux_layers_source=f"{_VLLM_DEFAULT}; llama.py; SGLang llama.py {_SGL_DEFAULT}",
        end_of_turn=("<|eot_id|>",), role_tokens=("<|start_header_id|>", "<|end_header_id|>"),
        reference={"Llama-3.1-8B-Instruct": dict(
            model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=32, hidden_size=4096,
            intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
            max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192}, tie_word_embeddings=False)},
        notes="Llama-3 RoPE scaling (rope_type llama3) is copied into the draft config.",
    ),
    Family(
        name="qwen3", title="Qwen3", model_types=("qwen3",), architectures=("Qwen3ForCausalLM",),
        transformers_class="Qwen3ForCausalLM", attention="gqa", moe=False,
        aux_layers_source=f"{_VLLM_DEFAULT}; qwen3.py; SGLang qwen3.py {_SGL_DEFAULT}",
        end_of_turn=("<|im_end|>",), role_tokens=("<|im_start|>",),
        reference={"Qwen3-8B": dict(
            model_type="qwen3", architectures=["Qwen3ForCausalLM"], num_hidden_layers=36, hidden_size=4096,
            intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
            max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False)},
        notes="q/k norms in the target only; the draft is a plain Llama layer. Thinking blocks follow the template.",
    ),
    Family(
        name="qwen3_moe", title="Qwen3-MoE", model_types=("qwen3_moe",), architectures=("Qwen3MoeForCausalLM",),
        transformers_class="Qwen3MoeForCausalLM", attention="gqa", moe=True,
        aux_layers_source=f"{_VLLM_DEFAULT}; qwen3_moe.py; SGLang qwen3_moe.py {_SGL_DEFAULT}",
        end_of_turn=("<|im_end|>",), role_tokens=("<|im_start|>",),
        reference={"Qwen3-30B-A3B": dict(
            model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=48, hidden_size=2048,
            intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
            num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
            max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False)},
        notes="The draft's MLP is dense; its default width is the target's dense intermediate_size.",
    ),
    Family(
        name="deepseek_v3", title="DeepSeek-V3 / Kimi-K2", model_types=("deepseek_v3", "kimi_k2"),
        architectures=("DeepseekV3ForCausalLM",), transformers_class="DeepseekV3ForCausalLM", attention="mla",
        moe=True, draft_head_dim_key="v_head_dim",
        aux_layers_source=("vllm/model_executor/models/deepseek_v2.py get_eagle3_aux_hidden_state_layers: "
                           f"(2, N//2, N-3) hf_index; SGLang deepseek_v2.py {_SGL_DEFAULT}"),
        end_of_turn=("<｜end▁of▁sentence｜>", "<|im_end|>"),
        role_tokens=("<｜User｜>", "<｜Assistant｜>", "<|im_system|>", "<|im_user|>", "<|im_assistant|>",
                     "<|im_middle|>"),
        reference={
            "DeepSeek-V3": dict(
                model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], num_hidden_layers=61,
                hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
                n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3, n_group=8, topk_group=4,
                topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
                num_attention_heads=128,
                num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280, max_position_embeddings=163840,
                rms_norm_eps=1e-6, rope_theta=10000.0,
                rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                              "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                tie_word_embeddings=False),
            "Kimi-K2-Instruct": dict(
                model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], num_hidden_layers=61,
                hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=384,
                n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1, n_group=1, topk_group=1,
                topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.827,
                num_attention_heads=64,
                num_key_value_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                qk_rope_head_dim=64, v_head_dim=128, vocab_size=163840, max_position_embeddings=131072,
                rms_norm_eps=1e-6, rope_theta=50000.0,
                rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                              "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                tie_word_embeddings=False, bos_token_id=163584, eos_token_id=163585),
        },
        notes=("Kimi-K2 ships model_type kimi_k2 with DeepseekV3ForCausalLM weights; transformers runs it as "
               "deepseek_v3. YaRN scaling and max positions are copied into the draft config. A 7168-wide draft is "
               "not required: set train.draft.hidden_size (the draft then keeps its own embed_tokens)."),
    ),
    Family(
        name="gpt_oss", title="gpt-oss", model_types=("gpt_oss",), architectures=("GptOssForCausalLM",),
        transformers_class="GptOssForCausalLM", attention="gqa+sinks, sliding every other layer", moe=True,
        aux_layers_source=f"{_VLLM_DEFAULT}; gpt_oss.py; SGLang gpt_oss.py {_SGL_DEFAULT}",
        end_of_turn=("<|return|>", "<|end|>", "<|call|>"),
        role_tokens=("<|start|>", "<|channel|>", "<|message|>"),
        reference={"gpt-oss-20b": dict(
            model_type="gpt_oss", architectures=["GptOssForCausalLM"], num_hidden_layers=24, hidden_size=2880,
            intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4, num_attention_heads=64,
            num_key_value_heads=8, head_dim=64, sliding_window=128, vocab_size=201088,
            max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=150000.0,
            rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                          "truncate": False, "original_max_position_embeddings": 4096},
            tie_word_embeddings=False)},
        notes=("Harmony template: the channel tokens after <|start|>assistant are the model's and are trained. "
               "The draft has no attention sinks and no sliding window (engines load a Llama draft)."),
    ),
    Family(
        name="gemma3", title="Gemma 3", model_types=("gemma3_text", "gemma3"), architectures=("Gemma3ForCausalLM",),
        transformers_class="Gemma3ForCausalLM", attention="gqa, sliding 5 of 6 layers", moe=False,
        aux_layers_source=("SGLang gemma3_causal.py " + _SGL_DEFAULT + "; vLLM 0.32 gemma3.py has no SupportsEagle3"),
        rope_layer_type="full_attention", embedding_multiplier="sqrt_hidden",
        end_of_turn=("<end_of_turn>",), role_tokens=("<start_of_turn>",), vllm_eagle3=False,
        reference={"gemma-3-1b-it": dict(
            model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], num_hidden_layers=26, hidden_size=1152,
            intermediate_size=6912, num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
            vocab_size=262144, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
            rope_local_base_freq=10000.0, query_pre_attn_scalar=256, tie_word_embeddings=True)},
        notes=("The target multiplies embeddings by sqrt(hidden) in its forward; SGLang shares the raw table with "
               "the draft, as Eyas trains it. vLLM 0.32 does not serve EAGLE-3 for Gemma 3. SGLang's gemma3_causal "
               "captures the layer input of its fused-residual layout; check its aux states against Hugging Face "
               "before serving a Gemma 3 drafter there."),
    ),
]}

# Targets whose family is not listed get the engines' generic default (vLLM's SupportsEagle3 interface default).
GENERIC = Family(name="generic", title="other (Llama-like)", model_types=(), architectures=(),
                 transformers_class="AutoModelForCausalLM", attention="gqa", moe=False,
                 aux_layers_source=_VLLM_DEFAULT, vllm_eagle3=False, sglang_eagle3=False)


def family_of(target_cfg: dict) -> Family:
    """The :class:`Family` of a target's ``config.json`` dict (``model_type`` first, then ``architectures``);
    :data:`GENERIC` when neither is known. A multimodal wrapper's ``text_config`` is looked into."""
    cfg = text_config(target_cfg)
    mt = cfg.get("model_type")
    for fam in FAMILIES.values():
        if mt in fam.model_types:
            return fam
    archs = set(cfg.get("architectures") or target_cfg.get("architectures") or [])
    for fam in FAMILIES.values():
        if archs & set(fam.architectures):
            return fam
    return GENERIC


def text_config(target_cfg: dict) -> dict:
    """The language model's part of a config dict: ``text_config`` of a multimodal wrapper (Kimi-K2.5, Gemma 3
    4B+), else the dict itself."""
    tc = target_cfg.get("text_config")
    return tc if isinstance(tc, dict) and "hidden_size" in tc else target_cfg


def default_aux_layer_ids(num_layers: int, target_cfg: dict | None = None) -> list[int]:
    """The engines' default aux layers for this target, ``output_of_layer`` convention
    (N = 30 -> [1, 14, 26]; N = 61 -> [1, 29, 57]). ``target_cfg`` selects the family's rule.

    Raises :class:`ConfigError` when the three ids are not distinct and within the model (N < 6): set
    ``extract.layer_ids`` by hand for such small targets.
    """
    fam = family_of(target_cfg) if target_cfg is not None else GENERIC
    ids = fam.aux_layers(num_layers)
    check_layer_ids(ids, num_layers)
    return ids


def check_layer_ids(ids: list[int], num_layers: int) -> None:
    """Raise :class:`ConfigError` unless ``ids`` are distinct, ascending and in ``[0, num_layers)``."""
    if len(set(ids)) != len(ids) or sorted(ids) != list(ids) or any(i < 0 or i >= num_layers for i in ids):
        raise ConfigError(
            f"aux layer ids {ids} must be distinct, ascending and within 0..{num_layers - 1} "
            f"(0-based output-of-layer convention); set extract.layer_ids for a target with {num_layers} layers"
        )


def convert_layer_ids(ids: list[int], src: Convention, dst: Convention) -> list[int]:
    """Convert layer ids between conventions: ``hf_index = output_of_layer + 1``."""
    if src == dst:
        return list(ids)
    if src == "output_of_layer" and dst == "hf_index":
        return [i + 1 for i in ids]
    if src == "hf_index" and dst == "output_of_layer":
        return [i - 1 for i in ids]
    raise ValueError(f"unknown conventions {src} -> {dst}")


def rope_parameters(target_cfg: dict) -> dict:
    """The RoPE the draft must use, as a transformers-5 ``rope_parameters`` dict (``rope_type``, ``rope_theta`` and
    the scaling fields). Reads transformers-5 ``rope_parameters`` (flat, or nested per layer type as Gemma 3 writes
    it: the family's ``rope_layer_type`` is taken) and the v4 fields ``rope_theta`` + ``rope_scaling`` (``type`` is
    renamed ``rope_type``), as published configs (DeepSeek-V3's YaRN, Llama-3's llama3 scaling) still write them.
    """
    cfg = text_config(target_cfg)
    fam = family_of(target_cfg)
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and fam.rope_layer_type and isinstance(rp.get(fam.rope_layer_type), dict):
        rp = rp[fam.rope_layer_type]
    if isinstance(rp, dict) and "rope_theta" in rp:
        out = dict(rp)
    else:
        out = dict(cfg.get("rope_scaling") or {})
        out["rope_theta"] = float(cfg.get("rope_theta", 10000.0))
    out["rope_type"] = out.pop("type", None) or out.get("rope_type") or "default"
    return out


def draft_attention_defaults(target_cfg: dict) -> dict:
    """Draft fields that follow the target unless ``train.draft`` sets them: ``num_attention_heads``,
    ``num_key_value_heads``, ``head_dim``, ``intermediate_size``, ``max_position_embeddings``, ``rms_norm_eps``.

    ``head_dim`` comes from the family's ``draft_head_dim_key`` (``v_head_dim`` for MLA), else the target's
    ``head_dim``, else ``hidden_size // num_attention_heads``.
    """
    cfg = text_config(target_cfg)
    fam = family_of(target_cfg)
    nh = int(cfg["num_attention_heads"])
    hd = cfg.get(fam.draft_head_dim_key) or cfg.get("head_dim") or int(cfg["hidden_size"]) // nh
    return {
        "num_attention_heads": nh,
        "num_key_value_heads": int(cfg.get("num_key_value_heads") or nh),
        "head_dim": int(hd),
        "intermediate_size": int(cfg["intermediate_size"]),
        "max_position_embeddings": int(cfg.get("max_position_embeddings", 4096)),
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
    }


# ---------------------------------------------------------------------------------------------------------------
# What the engines serve: checked before any work, so a drafter no engine loads is refused at the start, not after
# extract and train (issue 12). Each rule was read from the engines' source:
# - SGLang python/sglang/srt/models/llama_eagle3.py: ``fc = Linear(target_hidden_size * 3, hidden_size)``: exactly
#   three aux states. vLLM vllm/model_executor/models/llama_eagle3.py sizes fc from ``num_aux_hidden_states``, else
#   the length of ``eagle_config``'s ids, else 3; a speculators config (vllm/transformers_utils/configs/speculators)
#   carries neither, so it is 3 there too. Eyas's exports therefore hold exactly three.
# - SGLang models/llama.py ``LlamaModel.forward``: ``if i in layers_to_capture: aux.append(hidden_states +
#   residual)`` runs before decoder layer i, for i in [start_layer, end_layer): it captures the inputs of layers
#   1..N-1 (layer 0's residual is None), i.e. ``output_of_layer`` 0..N-2; the output of the last layer is never
#   captured. vLLM 0.32 models/llama.py also captures after the last layer (``_maybe_add_hidden_state(..., idx + 1,
#   ...)``), so a vLLM-only drafter may use ``output_of_layer`` N-1.
# - Both engines capture in depth order (vLLM sorts and de-duplicates the ids), so the ids must be ascending and
#   distinct, or fc would see the states in another order than training did.
# - The draft vocabulary is a subset of the target's (d2t maps into it).

ENGINE_AUX_LAYERS = 3
ENGINES_OF_FORMAT = {"sglang": ("sglang", "vllm"), "vllm": ("vllm",)}  # export format -> engines that load it


def aux_layer_id_problems(ids: list[int], num_layers: int | None = None,
                          engines: tuple[str, ...] = ("sglang", "vllm")) -> list[str]:
    """Why the engines in ``engines`` cannot serve a drafter on aux layers ``ids`` (``output_of_layer``) of a target
    with ``num_layers`` decoder layers (unknown: the range is not checked). Empty when they can."""
    out = []
    if len(ids) != ENGINE_AUX_LAYERS:
        out.append(f"{len(ids)} ids {list(ids)}; the engines serve exactly {ENGINE_AUX_LAYERS} (SGLang's "
                   f"llama_eagle3.py builds fc as Linear(3 * target_hidden_size, hidden_size); vLLM assumes 3 for a "
                   f"speculators folder), so the export would fail after extract and train")
    if len(set(ids)) != len(ids) or sorted(ids) != list(ids):
        out.append(f"{list(ids)} must be distinct and ascending: the engines capture layers in depth order")
    if num_layers is not None:
        last = num_layers - 2 if "sglang" in engines else num_layers - 1
        bad = [i for i in ids if i < 0 or i > last]
        if bad:
            why = (f"SGLang captures the inputs of decoder layers 1..{num_layers - 1}, i.e. outputs of layers "
                   f"0..{num_layers - 2}, never the last layer's output" if "sglang" in engines else
                   f"the target has layers 0..{num_layers - 1}")
            out.append(f"{bad} outside 0..{last} for a {num_layers}-layer target ({why})")
    elif any(i < 0 for i in ids):
        out.append(f"{list(ids)}: layer ids are 0-based and not negative")
    return out


def servable_problems(target_cfg: dict, *, layer_ids: list[int] | None, draft_vocab_size: int | None,
                      formats: list[str], evaluate_engine: str | None = None) -> tuple[list[str], list[str]]:
    """``(errors, warnings)``: what keeps the engines that load ``formats`` from serving this run's drafter, each
    naming the config field and the engine rule. ``layer_ids`` None means the family's default; when a toy target is
    too shallow for it, that is a warning here (the extract stage refuses it), so data-only stages still run."""
    cfg = text_config(target_cfg)
    fam = family_of(target_cfg)
    n = int(cfg["num_hidden_layers"])
    engines = tuple(dict.fromkeys(e for f in formats for e in ENGINES_OF_FORMAT[f]))
    errors, warnings = [], []
    if layer_ids is not None:
        errors += [f"extract.layer_ids: {p}" for p in aux_layer_id_problems(layer_ids, n, engines)]
    else:  # the family's default: only a toy target is too shallow for it; extract refuses it, say so now
        default = fam.aux_layers(n)
        if aux_layer_id_problems(default, n, engines):
            warnings.append(f"extract.layer_ids: unset, and the engines' default {default} does not fit this "
                            f"{n}-layer target; set extract.layer_ids before extract (it refuses)")
    vocab = int(cfg["vocab_size"])
    if draft_vocab_size is not None and draft_vocab_size > vocab:
        errors.append(f"vocab.draft_vocab_size: {draft_vocab_size} exceeds the target vocabulary ({vocab}): d2t maps "
                      f"draft ids into the target's vocabulary")
    asked = {f"export.formats: {f}": ENGINES_OF_FORMAT[f][0] for f in formats}
    if evaluate_engine == "vllm":
        asked["evaluate.engine: vllm"] = "vllm"
    for field_, engine in asked.items():
        served = fam.sglang_eagle3 if engine == "sglang" else fam.vllm_eagle3
        if served:
            continue
        if fam is GENERIC:
            warnings.append(f"{field_}: {cfg.get('model_type')!r} is not a family Eyas knows; whether {engine} serves "
                            f"EAGLE-3 for it is unchecked")
        else:
            errors.append(f"{field_}: {engine} does not serve an EAGLE-3 drafter for {fam.title} targets "
                          f"({fam.aux_layers_source})")
    return errors, warnings


def check_servable(target_cfg: dict, *, layer_ids: list[int] | None, draft_vocab_size: int | None,
                   formats: list[str], evaluate_engine: str | None = None, log=None) -> None:
    """Raise :class:`ConfigError` listing every problem of :func:`servable_problems`; warnings go to ``log``."""
    errors, warnings = servable_problems(target_cfg, layer_ids=layer_ids, draft_vocab_size=draft_vocab_size,
                                         formats=formats, evaluate_engine=evaluate_engine)
    for w in warnings if log else ():
        log(f"[eyas] warning: {w}")
    if errors:
        raise ConfigError("the configured drafter cannot be served; refused before any work:\n  "
                          + "\n  ".join(errors))


def check_run_servable(cfg, target_cfg: dict, log=None) -> None:
    """:func:`check_servable` for a run config (``eyas.config.RunConfig``: its extract, vocab, export and evaluate
    sections). Called by the first stage that knows the target and again by each stage the fields change."""
    check_servable(target_cfg, layer_ids=cfg.extract.layer_ids, draft_vocab_size=cfg.vocab.draft_vocab_size,
                   formats=list(cfg.export.formats), evaluate_engine=cfg.evaluate.engine, log=log)

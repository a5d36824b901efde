"""The one key table: the drafter's tensor names and what each engine calls them, with each engine's layer-id
convention (FIELD_NOTES "Checkpoints the engines load").

The draft model's attribute names (:class:`~eyas.model.eagle3.Eagle3DraftModel`) are SGLang's weight names
(python/sglang/srt/models/llama_eagle3.py), and an Eyas drafter folder (:mod:`eyas.drafter`) uses them too.
vLLM's speculators format names the decoder layer ``layers.0.`` instead of ``midlayer.``
(vllm/model_executor/models/llama_eagle3.py maps ``midlayer.`` to the same parameters); a draft of more than one
decoder layer has its stacked layers under ``layers.1.``, ``layers.2.``, ... by vLLM's names in every folder (SGLang
loads one layer only: :func:`engine_problems`). ``embed_tokens.weight``
belongs only to a draft with its own embedding table (:attr:`~eyas.model.eagle3.Eagle3Config.own_embedding`);
otherwise the engines share the target's. Both engines read ``d2t`` as offsets and ignore ``t2d``.

Exporting is renaming by this table plus a dtype cast (:func:`engine_state`); reading any folder is renaming back
(:func:`model_name`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import EyasError
from ..families import Convention
from ..model.eagle3 import Eagle3Config


@dataclass(frozen=True)
class Engine:
    """One engine's view of a drafter folder: the prefix it writes for decoder-layer weights, the prefixes its
    loader accepts for them, what it does with a weight it does not know, and the convention of its top-level
    layer ids."""

    layer_prefix: str
    reads_prefixes: tuple[str, ...]
    on_unknown: str
    layer_convention: Convention


ENGINES: dict[str, Engine] = {
    "sglang": Engine("midlayer.", ("midlayer.",), "SGLang would skip it silently", "output_of_layer"),
    "vllm": Engine("layers.0.", ("layers.0.", "midlayer."), "vLLM's weight loader raises on it", "hf_index"),
}

#: the one-layer drafter's tensors, model (= SGLang) names; ``embed_tokens.weight`` is added for a draft with its
#: own table, a stacked layer's :func:`stacked_layer_keys` for a deeper one
DRAFT_KEYS = frozenset(
    [f"midlayer.self_attn.{p}_proj.weight" for p in ("q", "k", "v", "o")]
    + [f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    + [f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")]
    + ["fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"]
)
EMBED = "embed_tokens.weight"

#: a stacked layer's tensors after its ``layers.i.`` prefix (``hidden_norm`` unused: vLLM builds it in every layer)
STACKED = ([f"self_attn.{p}_proj.weight" for p in ("q", "k", "v", "o")]
           + [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
           + [f"{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")])


def stacked_layer_keys(cfg: Eagle3Config) -> frozenset[str]:
    """``layers.i.*`` for the stacked layers i = 1 .. num_hidden_layers - 1 (empty for a one-layer draft)."""
    return frozenset(f"layers.{i}.{n}" for i in range(1, cfg.num_hidden_layers) for n in STACKED)


def engine_problems(cfg: Eagle3Config, engine: str) -> list[str]:
    """Why ``engine`` cannot load a draft shaped ``cfg`` at all (empty when it can): SGLang's llama_eagle3.py raises
    ``EAGLE3 currently only supports 1 layer`` on ``num_hidden_layers != 1``."""
    if engine == "sglang" and cfg.num_hidden_layers != 1:
        return [f"the draft has {cfg.num_hidden_layers} decoder layers and SGLang's EAGLE-3 model loads exactly one "
                f"(llama_eagle3.py raises 'EAGLE3 currently only supports 1 layer'); export it for vllm only"]
    return []


def draft_keys(cfg: Eagle3Config) -> frozenset[str]:
    """:data:`DRAFT_KEYS`, plus ``embed_tokens.weight`` for a draft with its own embedding table, less ``d2t`` for a
    draft whose vocabulary is the target's: vLLM then builds no d2t parameter (llama_eagle3.py:
    ``draft_id_to_target_id = None`` when ``draft_vocab_size`` equals the target vocabulary) and its weight loader
    raises on one; SGLang without d2t uses the draft logits as target ids (no hot-token map), the same thing."""
    keys = DRAFT_KEYS | stacked_layer_keys(cfg)
    keys = keys | {EMBED} if cfg.own_embedding else keys
    return keys - {"d2t"} if full_vocabulary(cfg) else keys


def full_vocabulary(cfg: Eagle3Config) -> bool:
    """The draft predicts over the target's whole vocabulary (no d2t map is written or read)."""
    return cfg.draft_vocab_size == cfg.vocab_size


def engine_name(key: str, engine: str) -> str:
    """Model name -> ``engine``'s name (``midlayer.`` -> ``layers.0.`` for vLLM)."""
    prefix = ENGINES[engine].layer_prefix
    return prefix + key[len("midlayer."):] if key.startswith("midlayer.") else key


def model_name(key: str, engine: str | None = None) -> str:
    """An engine's name -> the model name (``layers.0.`` -> ``midlayer.``), as ``engine``'s loader maps it (any
    engine's when ``None``); names it does not map are returned unchanged."""
    prefixes = ENGINES[engine].reads_prefixes if engine else tuple(p for e in ENGINES.values()
                                                                    for p in e.reads_prefixes)
    for p in prefixes:
        if key.startswith(p):
            return "midlayer." + key[len(p):]
    return key


def engine_keys(cfg: Eagle3Config, engine: str) -> frozenset[str]:
    """The exact tensor names ``engine`` loads for a draft shaped ``cfg``."""
    return frozenset(engine_name(k, engine) for k in draft_keys(cfg))


SGLANG_KEYS = frozenset(engine_name(k, "sglang") for k in DRAFT_KEYS)
VLLM_KEYS = frozenset(engine_name(k, "vllm") for k in DRAFT_KEYS)


def check_state_shapes(state: dict[str, torch.Tensor], cfg: Eagle3Config) -> list[str]:
    """Shape and dtype problems of the tensors present in ``state`` (model names) against ``cfg``.

    ``d2t`` must be int64 offsets (a float d2t cannot hold large token ids exactly: bf16 is exact only to 256);
    ``t2d`` must be bool.
    """
    problems = []
    H, Ht, Dv, V = cfg.hidden_size, cfg.target_hidden_size, cfg.draft_vocab_size, cfg.vocab_size
    expect = {
        "fc.weight": (H, cfg.num_aux_layers * Ht), "lm_head.weight": (Dv, H), "norm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (cfg.num_attention_heads * cfg.head_dim, 2 * H),
        "midlayer.self_attn.k_proj.weight": (cfg.num_key_value_heads * cfg.head_dim, 2 * H),
        "midlayer.self_attn.v_proj.weight": (cfg.num_key_value_heads * cfg.head_dim, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, cfg.num_attention_heads * cfg.head_dim),
        "midlayer.mlp.gate_proj.weight": (cfg.intermediate_size, H),
        "midlayer.mlp.up_proj.weight": (cfg.intermediate_size, H),
        "midlayer.mlp.down_proj.weight": (H, cfg.intermediate_size),
        "d2t": (Dv,), "t2d": (V,), EMBED: (V, H),
    }
    for i in range(1, cfg.num_hidden_layers):
        a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        expect.update({
            a + "q_proj.weight": (cfg.num_attention_heads * cfg.head_dim, H),
            a + "k_proj.weight": (cfg.num_key_value_heads * cfg.head_dim, H),
            a + "v_proj.weight": (cfg.num_key_value_heads * cfg.head_dim, H),
            a + "o_proj.weight": (H, cfg.num_attention_heads * cfg.head_dim),
            m + "gate_proj.weight": (cfg.intermediate_size, H), m + "up_proj.weight": (cfg.intermediate_size, H),
            m + "down_proj.weight": (H, cfg.intermediate_size),
        })
    for k, shape in expect.items():
        if k in state and tuple(state[k].shape) != shape:
            problems.append(f"{k} has shape {tuple(state[k].shape)}, expected {shape}")
    if "d2t" in state and state["d2t"].dtype != torch.int64:
        problems.append(f"d2t is {state['d2t'].dtype}, expected int64 offsets")
    if "t2d" in state and state["t2d"].dtype != torch.bool:
        problems.append(f"t2d is {state['t2d'].dtype}, expected bool")
    return problems


def check_keys(state: dict[str, torch.Tensor], cfg: Eagle3Config, engine: str) -> list[str]:
    """Problems with an ``engine``-named state dict as that engine would load it: missing and unknown names,
    shapes, dtypes. Empty when fine."""
    expected = engine_keys(cfg, engine)
    problems = engine_problems(cfg, engine)
    problems += [f"missing {k}" for k in sorted(expected - set(state))]
    problems += [f"unknown key {k} ({ENGINES[engine].on_unknown})" for k in sorted(set(state) - expected)]
    return problems + check_state_shapes({model_name(k): v for k, v in state.items()}, cfg)


def engine_state(state: dict[str, torch.Tensor], cfg: Eagle3Config, engine: str,
                 dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """A drafter's tensors (model names) as ``engine`` loads them: renamed by the table, floats cast to ``dtype``,
    contiguous on the CPU. Raises :class:`EyasError` when the key check (:func:`check_keys`) fails."""
    out = {}
    keep = draft_keys(cfg)
    for k, v in state.items():
        if k not in keep:
            continue   # d2t of a full-vocabulary draft (see draft_keys)
        v = v.detach().cpu()
        out[engine_name(k, engine)] = (v.to(dtype) if v.is_floating_point() else v).contiguous()
    problems = check_keys(out, cfg, engine)
    if problems:
        raise EyasError(f"{engine} export check failed:\n  " + "\n  ".join(problems))
    return out

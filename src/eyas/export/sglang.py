"""The SGLang EAGLE-3 folder (python/sglang/srt/models/llama_eagle3.py): ``config.json`` + ``model.safetensors``.

SGLang skips weight names it does not know without a word, so the key set is checked against
:data:`SGLANG_KEYS` before anything is written. Layer ids go to ``eagle_config.eagle_aux_hidden_state_layer_ids``
in SGLang's convention (``output_of_layer``; SGLang adds 1 internally). No ``embed_tokens``: engines share the
target's embedding table.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import EyasError
from ..families import convert_layer_ids
from ..io import atomic_path, write_json_atomic
from ..model.eagle3 import Eagle3Config, Eagle3DraftModel

# The exact tensors SGLang's LlamaForCausalLMEagle3 loads (FIELD_NOTES "Checkpoints the engines load").
SGLANG_KEYS = frozenset(
    [f"midlayer.self_attn.{p}_proj.weight" for p in ("q", "k", "v", "o")]
    + [f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    + [f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")]
    + ["fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"]
)


def check_sglang_keys(state: dict[str, torch.Tensor], cfg: Eagle3Config) -> list[str]:
    """Problems with a state dict as SGLang would load it: missing/unknown keys, shapes, dtypes. Empty when fine."""
    problems = []
    keys, expected = set(state), sglang_keys(cfg)
    for k in sorted(expected - keys):
        problems.append(f"missing {k}")
    for k in sorted(keys - expected):
        problems.append(f"unknown key {k} (SGLang would skip it silently)")
    return problems + check_state_shapes(state, cfg)


def sglang_keys(cfg: Eagle3Config) -> frozenset[str]:
    """:data:`SGLANG_KEYS`, plus ``embed_tokens.weight`` for a draft with its own embedding table, less ``d2t`` for a
    draft whose vocabulary is the target's: vLLM then builds no d2t parameter (llama_eagle3.py:
    ``draft_id_to_target_id = None`` when ``draft_vocab_size`` equals the target vocabulary) and its weight loader
    raises on one; SGLang without d2t uses the draft logits as target ids (no hot-token map), the same thing."""
    keys = SGLANG_KEYS | {"embed_tokens.weight"} if cfg.own_embedding else SGLANG_KEYS
    return keys - {"d2t"} if full_vocabulary(cfg) else keys


def full_vocabulary(cfg: Eagle3Config) -> bool:
    """The draft predicts over the target's whole vocabulary (no d2t map is written or read)."""
    return cfg.draft_vocab_size == cfg.vocab_size


def check_state_shapes(state: dict[str, torch.Tensor], cfg: Eagle3Config) -> list[str]:
    """Shape and dtype problems of the tensors present in ``state`` (``midlayer.*`` names) against ``cfg``.

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
        "d2t": (Dv,), "t2d": (V,), "embed_tokens.weight": (V, H),
    }
    for k, shape in expect.items():
        if k in state and tuple(state[k].shape) != shape:
            problems.append(f"{k} has shape {tuple(state[k].shape)}, expected {shape}")
    if "d2t" in state and state["d2t"].dtype != torch.int64:
        problems.append(f"d2t is {state['d2t'].dtype}, expected int64 offsets")
    if "t2d" in state and state["t2d"].dtype != torch.bool:
        problems.append(f"t2d is {state['t2d'].dtype}, expected bool")
    return problems


def rope_fields(cfg: Eagle3Config) -> dict:
    """The target's RoPE as Llama config fields: ``max_position_embeddings``, ``rope_theta``, ``rope_scaling``."""
    rp = dict(cfg.rope_parameters)
    rope_theta = float(rp.pop("rope_theta", 10000.0))
    rope_type = rp.get("rope_type", "default")
    return {"max_position_embeddings": cfg.max_position_embeddings, "rope_theta": rope_theta,
            "rope_scaling": None if rope_type == "default" else rp}


def sglang_config(cfg: Eagle3Config, layer_ids: list[int], convention: str, target_cfg: dict) -> dict:
    """config.json for SGLang: a one-layer Llama config plus the EAGLE-3 fields and the target's RoPE.

    The same layer ids are written twice, once per engine convention: ``eagle_config.eagle_aux_hidden_state_layer_ids``
    (``output_of_layer``; SGLang adds 1, models/llama.py ``set_eagle3_layers_to_capture``) and a top-level
    ``eagle_aux_hidden_state_layer_ids`` (``hf_index``). vLLM reads the top-level key first and otherwise takes
    ``eagle_config``'s ids *as they are*, as hf_index (v1/worker/gpu_model_runner.py
    ``_get_eagle3_aux_layers_from_config``; its V2 runner ignores ``eagle_config`` ids altogether), so without the
    top-level key vLLM would capture every layer one too early. SGLang reads only ``eagle_config``.
    """
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,
        **rope_fields(cfg),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": convert_layer_ids(layer_ids, convention, "output_of_layer"),
            "use_aux_hidden_state": True,
        },
        "eagle_aux_hidden_state_layer_ids": convert_layer_ids(layer_ids, convention, "hf_index"),
        "bos_token_id": target_cfg.get("bos_token_id"),
        "eos_token_id": target_cfg.get("eos_token_id"),
        "pad_token_id": target_cfg.get("pad_token_id"),
        "torch_dtype": "bfloat16",
    }


def write_sglang(out_dir: Path, model: Eagle3DraftModel, layer_ids: list[int], convention: str,
                 target_cfg: dict, dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int | None = None) -> Path:
    """Write the SGLang folder; raises :class:`EyasError` (and writes nothing) when the key check fails."""
    state = {}
    for k, v in model.trainable_state_dict().items():
        if k not in sglang_keys(model.config):
            continue   # d2t of a full-vocabulary draft (see sglang_keys)
        v = v.detach().cpu()
        state[k] = v.to(dtype) if v.is_floating_point() else v
    problems = check_sglang_keys(state, model.config)
    if problems:
        raise EyasError("SGLang export check failed:\n  " + "\n  ".join(problems))
    out_dir.mkdir(parents=True, exist_ok=True)
    write_weights(out_dir, state, max_shard_bytes)
    write_json_atomic(out_dir / "config.json", sglang_config(model.config, layer_ids, convention, target_cfg))
    return out_dir


def write_weights(out_dir: Path, state: dict[str, torch.Tensor], max_shard_bytes: int | None = None) -> list[str]:
    """``model.safetensors``, or with ``max_shard_bytes`` the Hugging Face sharded layout both engines load
    (``model-0000i-of-0000n.safetensors`` of at most that many bytes each, whole tensors, plus
    ``model.safetensors.index.json`` with ``weight_map``). Returns the file names. Raises :class:`EyasError` when
    one tensor alone is larger than a shard may be (name, size and the limit)."""
    for old in list(out_dir.glob("model*.safetensors")) + list(out_dir.glob("model.safetensors.index.json")):
        old.unlink()
    items = [(k, v.contiguous()) for k, v in state.items()]
    if not max_shard_bytes:
        with atomic_path(out_dir / "model.safetensors") as tmp:
            save_file(dict(items), str(tmp), metadata={"format": "pt"})
        return ["model.safetensors"]
    header = 1 << 16                                        # room for a shard's safetensors header
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for k, v in items:
        n = v.numel() * v.element_size()
        if n + header > max_shard_bytes:
            raise EyasError(f"export: {k} alone is {n:,} bytes, over export.max_shard_bytes={max_shard_bytes:,} "
                            f"(a smaller draft vocabulary, vocab.coverage, or a larger limit)")
        if shards[-1] and size + n + header > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((k, v))
        size += n
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        with atomic_path(out_dir / name) as tmp:
            save_file(dict(shard), str(tmp), metadata={"format": "pt"})
        weight_map.update({k: name for k, _ in shard})
    total = sum(v.numel() * v.element_size() for _, v in items)
    write_json_atomic(out_dir / "model.safetensors.index.json",
                      {"metadata": {"total_size": total}, "weight_map": weight_map})
    return names


def load_sglang_draft(folder: Path, embed: torch.Tensor) -> tuple[Eagle3DraftModel, list[int]]:
    """Load an SGLang-format EAGLE-3 folder (ours or another trainer's) into :class:`Eagle3DraftModel`.

    ``embed`` is the target's embedding table [V, Ht] (unused by a draft with its own table). Returns the model (fp32, eval) and the aux layer ids in the
    ``output_of_layer`` convention. Raises :class:`EyasError` when the folder does not pass the key check.
    """
    cfg_json = json.loads((folder / "config.json").read_text())
    state = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(f)))
    rp = dict(cfg_json.get("rope_scaling") or {"rope_type": "default"})
    rp.setdefault("rope_type", rp.pop("type", "default"))
    rp["rope_theta"] = float(cfg_json.get("rope_theta", 10000.0))
    H = int(cfg_json["hidden_size"])
    cfg = Eagle3Config(
        hidden_size=H, intermediate_size=int(cfg_json["intermediate_size"]),
        num_attention_heads=int(cfg_json["num_attention_heads"]),
        num_key_value_heads=int(cfg_json.get("num_key_value_heads", cfg_json["num_attention_heads"])),
        head_dim=int(cfg_json.get("head_dim") or H // int(cfg_json["num_attention_heads"])),
        target_hidden_size=int(cfg_json.get("target_hidden_size") or H),
        vocab_size=int(cfg_json["vocab_size"]), draft_vocab_size=int(cfg_json.get("draft_vocab_size")
                                                                     or cfg_json["vocab_size"]),
        rms_norm_eps=float(cfg_json.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg_json.get("max_position_embeddings", 4096)), rope_parameters=rp,
    )
    problems = check_sglang_keys(state, cfg)
    if problems:
        raise EyasError(f"{folder}: not a loadable SGLang EAGLE-3 folder:\n  " + "\n  ".join(problems))
    model = Eagle3DraftModel(cfg)
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=False)
    if not cfg.own_embedding:
        with torch.no_grad():
            model.embed_tokens.weight.copy_(embed)
    ids = cfg_json.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    return model.eval(), ids

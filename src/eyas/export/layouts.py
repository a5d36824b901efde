"""``config.json`` of the two engine layouts, read and written in one place.

- ``sglang``: a Llama config with ``architectures: ["LlamaForCausalLMEagle3"]``, loaded by SGLang
  (python/sglang/srt/models/llama_eagle3.py) and by vLLM (vllm/model_executor/models/llama_eagle3.py);
- ``speculators``: ``speculators_config`` + ``transformer_layer_config`` (the same one-layer Llama config), loaded
  by vLLM only (vllm/transformers_utils/configs/speculators/).

Aux layer ids, as the index into Hugging Face ``output_hidden_states`` (``hf_index``) each engine captures: SGLang
reads ``eagle_config.eagle_aux_hidden_state_layer_ids`` and adds 1 (models/llama.py ``set_eagle3_layers_to_capture``);
vLLM reads the top-level ``eagle_aux_hidden_state_layer_ids`` as it is, else ``eagle_config``'s ids *as they are*
(v1/worker/gpu_model_runner.py ``_get_eagle3_aux_layers_from_config``), else its default (2, N//2, N-3).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import EyasError
from ..families import convert_layer_ids, engine_default_aux_layer_ids
from ..model.eagle3 import Eagle3Config


def read_config(folder: Path) -> dict:
    """A draft folder's ``config.json``; raises :class:`EyasError` when it is missing or not JSON."""
    p = Path(folder) / "config.json"
    if not p.exists():
        raise EyasError(f"{folder}: no config.json (not a draft model folder)")
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise EyasError(f"{p}:{e.lineno}: invalid JSON ({e.msg})") from None


def layout_of(cfg: dict) -> str:
    """``speculators``, ``sglang`` (a LlamaForCausalLMEagle3-style config) or ``unknown``."""
    if "speculators_config" in cfg or "speculators_model_type" in cfg:
        return "speculators"
    if any("Eagle3" in a for a in cfg.get("architectures") or []):
        return "sglang"
    return "unknown"


def layer_config(cfg: dict) -> dict | None:
    """The Llama fields of a config: the top level for the ``sglang`` layout, ``transformer_layer_config`` for
    ``speculators`` (``None`` when missing)."""
    return cfg.get("transformer_layer_config") if layout_of(cfg) == "speculators" else cfg


def draft_config_from(cfg: dict, layer: dict, fc_in: int | None = None) -> Eagle3Config:
    """An :class:`Eagle3Config` from a folder's config (``layer``: :func:`layer_config`). ``fc_in``: the width of
    ``fc.weight``'s input, used for the target width when the config does not say. Raises :class:`EyasError` on
    missing fields."""
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in layer]
    if missing:
        raise EyasError(f"config.json lacks {', '.join(missing)}")
    H = int(layer["hidden_size"])
    rp = dict(layer.get("rope_scaling") or layer.get("rope_parameters") or {"rope_type": "default"})
    rp.setdefault("rope_type", rp.pop("type", "default"))
    rp["rope_theta"] = float(layer.get("rope_theta") or rp.get("rope_theta") or 10000.0)
    Ht = cfg.get("target_hidden_size") or layer.get("target_hidden_size") or (fc_in // 3 if fc_in else H)
    return Eagle3Config(
        hidden_size=H, intermediate_size=int(layer["intermediate_size"]),
        num_attention_heads=int(layer["num_attention_heads"]),
        num_key_value_heads=int(layer.get("num_key_value_heads") or layer["num_attention_heads"]),
        head_dim=int(layer.get("head_dim") or H // int(layer["num_attention_heads"])),
        target_hidden_size=int(Ht), vocab_size=int(layer["vocab_size"]),
        draft_vocab_size=int(cfg.get("draft_vocab_size") or layer.get("draft_vocab_size") or layer["vocab_size"]),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(layer.get("max_position_embeddings", 4096)), rope_parameters=rp,
        num_hidden_layers=int(layer.get("num_hidden_layers") or 1),
    )


def engine_layer_ids(cfg: dict, num_target_layers: int | None) -> dict[str, list[int] | None]:
    """The hf_index ids each engine would capture for this config (module docstring); an engine's default needs
    ``num_target_layers`` (``None`` without it)."""
    default = (convert_layer_ids(engine_default_aux_layer_ids(num_target_layers), "output_of_layer", "hf_index")
               if num_target_layers else None)
    eagle_ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top_ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    out: dict[str, list[int] | None] = {}
    if layout_of(cfg) == "sglang":
        out["sglang"] = [i + 1 for i in eagle_ids] if eagle_ids else default
    vllm_ids = top_ids or eagle_ids
    out["vllm"] = sorted(set(vllm_ids)) if vllm_ids else default   # vLLM de-duplicates and sorts
    return out


def rope_fields(cfg: Eagle3Config) -> dict:
    """The target's RoPE as Llama config fields: ``max_position_embeddings``, ``rope_theta``, ``rope_scaling``."""
    rp = dict(cfg.rope_parameters)
    rope_theta = float(rp.pop("rope_theta", 10000.0))
    rope_type = rp.get("rope_type", "default")
    return {"max_position_embeddings": cfg.max_position_embeddings, "rope_theta": rope_theta,
            "rope_scaling": None if rope_type == "default" else rp}


def llama_shape(cfg: Eagle3Config) -> dict:
    """The draft's Llama shape both layouts write first (``sglang``: top level; ``speculators``:
    ``transformer_layer_config``)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
    }


def special_tokens(target_cfg: dict, *names: str) -> dict:
    """The target's special token ids (``bos_token_id``, ...) as the draft config repeats them."""
    return {n: target_cfg.get(n) for n in names}


def write_weights(out_dir: Path, state: dict, max_shard_bytes: int | None = None) -> list[str]:
    """An engine folder's weights: ``model.safetensors``, or with ``max_shard_bytes`` the Hugging Face sharded
    layout both engines load (``model-0000i-of-0000n.safetensors`` of at most that many bytes each, whole tensors,
    plus ``model.safetensors.index.json`` with ``weight_map``). Earlier weight files of the folder are removed.
    Returns the file names. Raises :class:`EyasError` when one tensor alone is larger than a shard may be (its name,
    size and the limit)."""
    from safetensors.torch import save_file

    from ..io import atomic_path, write_json_atomic

    for old in list(out_dir.glob("model*.safetensors")) + list(out_dir.glob("model.safetensors.index.json")):
        old.unlink()
    items = [(k, v.contiguous()) for k, v in state.items()]
    if not max_shard_bytes:
        with atomic_path(out_dir / "model.safetensors") as tmp:
            save_file(dict(items), str(tmp), metadata={"format": "pt"})
        return ["model.safetensors"]
    header = 1 << 16                                        # room for a shard's safetensors header
    shards: list[list] = [[]]
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

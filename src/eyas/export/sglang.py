"""The SGLang EAGLE-3 folder (python/sglang/srt/models/llama_eagle3.py): ``config.json`` + ``model.safetensors``.

SGLang skips weight names it does not know without a word, so the key set is checked against the key table
(:mod:`eyas.export.keys`) before anything is written. Layer ids go to ``eagle_config.eagle_aux_hidden_state_layer_ids``
in SGLang's convention (``output_of_layer``; SGLang adds 1 internally). No ``embed_tokens`` unless the draft has
its own table: engines share the target's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..drafter import DrafterWeights
from ..families import convert_layer_ids
from ..io import write_json_atomic
from ..model.eagle3 import Eagle3Config
from .keys import engine_state
from .layouts import llama_shape, rope_fields, special_tokens, write_weights


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
        **llama_shape(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,
        **rope_fields(cfg),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": convert_layer_ids(layer_ids, convention, "output_of_layer"),
            "use_aux_hidden_state": True,
        },
        "eagle_aux_hidden_state_layer_ids": convert_layer_ids(layer_ids, convention, "hf_index"),
        **special_tokens(target_cfg, "bos_token_id", "eos_token_id", "pad_token_id"),
        "torch_dtype": "bfloat16",
    }


def write_sglang(out_dir: Path, drafter: DrafterWeights, target_cfg: dict, dtype: torch.dtype = torch.bfloat16,
                 max_shard_bytes: int | None = None) -> Path:
    """Write the SGLang folder of a drafter; raises :class:`~eyas.errors.EyasError` (and writes nothing) when the key
    check fails."""
    cfg = drafter.config
    state = engine_state(drafter.state, cfg.draft, "sglang", dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_weights(out_dir, state, max_shard_bytes)
    write_json_atomic(out_dir / "config.json",
                      sglang_config(cfg.draft, cfg.aux_layer_ids, cfg.layer_convention, target_cfg))
    return out_dir

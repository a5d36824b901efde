"""Build the draft model for a target: shape from the target's config (overridable), frozen target embeddings,
the run's d2t/t2d."""

from __future__ import annotations

import torch

from ..config import DraftConfig
from ..errors import ConfigError
from ..families import draft_attention_defaults, rope_parameters, text_config
from ..model.eagle3 import Eagle3Config, Eagle3DraftModel


def draft_config_for(target_cfg: dict, draft: DraftConfig, draft_vocab_size: int, num_aux_layers: int) -> Eagle3Config:
    """The draft's :class:`Eagle3Config` for a target config dict; unset ``draft`` fields follow the target
    (per family: :func:`eyas.families.draft_attention_defaults`, e.g. ``head_dim = v_head_dim`` for MLA targets).

    A draft narrower than the target (``draft.hidden_size < Ht``) gets ``target_hidden_size = Ht`` (``fc`` stays
    ``3*Ht -> H``) and its own embedding table. Raises :class:`ConfigError` when the attention shape does not fit.
    """
    tc = text_config(target_cfg)
    Ht = int(tc["hidden_size"])
    H = draft.hidden_size or Ht
    dflt = draft_attention_defaults(target_cfg)
    nh = draft.num_attention_heads or dflt["num_attention_heads"]
    nkv = draft.num_key_value_heads or min(dflt["num_key_value_heads"], nh)
    if nh % nkv:
        raise ConfigError(f"train.draft: num_attention_heads={nh} is not a multiple of num_key_value_heads={nkv}")
    return Eagle3Config(
        hidden_size=H,
        intermediate_size=draft.intermediate_size or dflt["intermediate_size"],
        num_attention_heads=nh,
        num_key_value_heads=nkv,
        head_dim=draft.head_dim or dflt["head_dim"],
        target_hidden_size=Ht,
        vocab_size=int(tc["vocab_size"]),
        draft_vocab_size=draft_vocab_size,
        rms_norm_eps=dflt["rms_norm_eps"],
        max_position_embeddings=dflt["max_position_embeddings"],
        rope_parameters=rope_parameters(target_cfg),
        num_aux_layers=num_aux_layers,
        num_hidden_layers=draft.num_hidden_layers or 1,
    )


def projected_embedding(embed: torch.Tensor, width: int) -> torch.Tensor:
    """The target's embedding table [V, Ht] projected onto its ``width`` leading right-singular directions:
    [V, width] fp32, the best rank-``width`` linear summary of the table (a starting point for a narrower draft's
    own, trained, embedding). Deterministic: the directions are the top eigenvectors of the Gram matrix
    ``E^T E`` [Ht, Ht] (float64), each signed so that its largest entry is positive."""
    if width >= embed.shape[1]:
        return embed[:, :width].float().clone()
    e = embed.double()
    _, vecs = torch.linalg.eigh(e.T @ e)                      # ascending eigenvalues, vecs [Ht, Ht]
    v = vecs[:, -width:].flip(-1)                              # [Ht, width], leading direction first
    v = v * torch.sign(v.gather(0, v.abs().argmax(0, keepdim=True)))
    return (e @ v).float()


def build_draft(cfg: Eagle3Config, embed: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor,
                seed: int) -> Eagle3DraftModel:
    """A freshly initialised draft (seeded), with the target's embedding table (frozen) and the vocab maps."""
    torch.manual_seed(seed)
    model = Eagle3DraftModel(cfg)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(projected_embedding(embed, cfg.hidden_size) if cfg.own_embedding else embed)
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
    return model

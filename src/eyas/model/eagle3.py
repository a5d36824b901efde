"""The EAGLE-3 draft model, whole, with training-time test (TTT) unrolled in ``forward``.

Source: EAGLE-3 (arXiv 2503.01840); layout and weight names as SGLang loads them
(python/sglang/srt/models/llama_eagle3.py) and vLLM (vllm/model_executor/models/llama_eagle3.py):

    fc        Linear(3*Ht -> H, no bias)     fuses the three aux hidden states of the target
    midlayer  one decoder layer whose attention input is concat(input_layernorm(emb), hidden_norm(h)) [.., 2H];
              the residual adds the un-normalised h (norm_before_residual = False); post-attention norm; SwiGLU MLP
    layers.i  (i = 1 .. num_hidden_layers - 1; none by default) plain pre-norm Llama decoder layers on the H-wide
              residual stream after midlayer, as vLLM stacks them (llama_eagle3.py ``LlamaDecoderLayer`` with
              ``layer_idx > 0``: no embedding input, the residual carried on); SGLang loads one layer only
    norm      RMSNorm before the draft lm_head
    lm_head   Linear(H -> draft_vocab), trained, not tied
    embed_tokens  the target's embedding table, frozen and never exported (engines share the target's)

Shape legend: B batch, T tokens, H draft hidden, Ht target hidden, nh/nkv query/key-value heads, hd head dim,
Dv draft vocabulary, K TTT steps.

TTT (FIELD_NOTES, SpecForge): step 0 takes at position t the fused feature of target position t and the embedding
of token t+1, at position id t; the layer's pre-norm output h is fed back as step k+1's feature, with the token
embeddings shifted one more position and position ids t+k. At step k a query at t attends to the step-0 keys at
positions <= t (causal prefix) plus its own keys of steps 1..k at the same position (a diagonal per step): exactly
what the chain at anchor t sees when drafting at inference. Every stacked layer has its own keys under the same mask;
the fed-back h is the last layer's pre-norm output (vLLM's ``hidden_prenorm``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..data.vocab import draft_to_target_ids
from .attention import ATTENTION


@dataclass
class Eagle3Config:
    """Draft shape. ``vocab_size`` is the target's vocabulary; ``draft_vocab_size`` the lm_head's rows."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    num_aux_layers: int = 3
    num_hidden_layers: int = 1

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def own_embedding(self) -> bool:
        """A draft narrower (or wider) than the target cannot share the target's embedding table: it keeps its
        own ``embed_tokens`` [V, H], trained and exported, which SGLang (llama_eagle3.py keeps the loaded table when
        ``target_hidden_size != hidden_size``) and vLLM (llm_base_proposer.py ``_maybe_share_embeddings`` keeps
        it when the widths differ) both load."""
        return self.hidden_size != self.target_hidden_size


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, computed in fp32 (as transformers' LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """RoPE tables from transformers' own implementation, so every rope type (default, llama3, yarn) matches the
    target exactly. ``forward(positions [T]) -> (cos, sin)`` each [T, hd] in fp32."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        lcfg = LlamaConfig(
            hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
            max_position_embeddings=cfg.max_position_embeddings, rope_parameters=dict(cfg.rope_parameters),
        )
        self.inner = LlamaRotaryEmbedding(config=lcfg)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dummy = torch.empty(0, device=positions.device, dtype=torch.float32)
        cos, sin = self.inner(dummy, positions.view(1, -1))
        return cos[0], sin[0]


def _linear(x: torch.Tensor, layer: nn.Linear, weights: dict | None, name: str) -> torch.Tensor:
    """``layer(x)``, or ``weights[name]`` where it is given (a TTT forward's once-cast copy,
    :meth:`Eagle3DecoderLayer.ttt_weights`)."""
    w = None if weights is None else weights.get(name)
    return layer(x) if w is None else F.linear(x, w)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, T, hd]; cos/sin [T, hd]."""
    return (x * cos.to(x.dtype)) + (_rotate_half(x) * sin.to(x.dtype))


class Eagle3Attention(nn.Module):
    """Attention over a 2H-wide input. Training (TTT, causal prefix + diagonals) goes through
    :meth:`Eagle3DecoderLayer.ttt_step` and the kernel named by ``backend`` (:data:`eyas.model.attention.ATTENTION`);
    :meth:`decode` is inference with a key/value cache (plain causal)."""

    def __init__(self, cfg: Eagle3Config, input_size: int | None = None):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d = input_size or 2 * cfg.hidden_size
        self.q_proj = nn.Linear(d, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(d, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(d, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        self.backend = "sdpa"

    def _qkv(self, x, cos, sin, weights: dict | None = None):
        B, T, _ = x.shape
        q = _linear(x, self.q_proj, weights, "q").view(B, T, self.nh, self.hd).transpose(1, 2)   # [B, nh, T, hd]
        k = _linear(x, self.k_proj, weights, "k").view(B, T, self.nkv, self.hd).transpose(1, 2)  # [B, nkv, T, hd]
        v = _linear(x, self.v_proj, weights, "v").view(B, T, self.nkv, self.hd).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _out(self, o: torch.Tensor, weights: dict | None = None) -> torch.Tensor:
        B, _, T, _ = o.shape
        return _linear(o.transpose(1, 2).reshape(B, T, self.nh * self.hd), self.o_proj, weights, "o")

    def decode(self, x: torch.Tensor, cos, sin, kv: "KVCache", heads: slice) -> torch.Tensor:
        """Inference: x [B, S, 2H] (H for a stacked layer) new entries after ``kv.length`` cached ones; causal over
        cache + new. This layer's keys and values are ``kv``'s heads ``heads``; the new ones are staged in ``kv``
        (:meth:`KVCache.stage`) and appended with every layer's at once (:meth:`KVCache.commit`)."""
        q, k, v = self._qkv(x, cos, sin)
        k_all, v_all = kv.stage(k, v, heads)
        S, L = q.shape[2], k_all.shape[2]
        mask = torch.ones(S, L, dtype=torch.bool, device=q.device).tril(diagonal=L - S)
        o = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=self.nh != self.nkv)
        return self._out(o)


class KVCache:
    """The draft's key/value cache for decoding: ``k``, ``v`` [B, layers * nkv, L, hd], every decoder layer's heads
    side by side (layer i's at ``i * nkv .. (i+1) * nkv``), so that one entry along L holds a position for every
    layer and a decoder can expand, slice and concatenate entries without knowing the depth. A decode step stages
    each layer's new keys (:meth:`stage`) and appends them together (:meth:`commit`)."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self._new: list = []

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def stage(self, k, v, heads: slice):
        """One layer's new entries k, v [B, nkv, S, hd]; returns that layer's cached + new keys and values."""
        self._new.append((k, v))
        if self.k is None:
            return k, v
        return torch.cat([self.k[:, heads], k], dim=2), torch.cat([self.v[:, heads], v], dim=2)

    def commit(self) -> None:
        """Append the staged layers' entries (in layer order) as one entry per position."""
        k = torch.cat([k for k, _ in self._new], dim=1)
        v = torch.cat([v for _, v in self._new], dim=1)
        self._new = []
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, weights: dict | None = None):
        gate = F.silu(_linear(x, self.gate_proj, weights, "gate"))
        return _linear(gate * _linear(x, self.up_proj, weights, "up"), self.down_proj, weights, "down")


class Eagle3DecoderLayer(nn.Module):
    """``midlayer``: attention on concat(input_layernorm(emb), hidden_norm(h)), residual on the raw h."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Eagle3MLP(cfg)

    def forward(self, emb, hidden, cos, sin, kv: "KVCache", heads: slice) -> torch.Tensor:
        """Inference: emb, hidden [B, S, H] -> new hidden [B, S, H] (pre-norm); ``kv``: the cache, this layer's
        heads at ``heads`` (:meth:`Eagle3Attention.decode`)."""
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)  # [B, S, 2H]
        h = hidden + self.self_attn.decode(x, cos, sin, kv, heads)
        return h + self.mlp(self.post_attention_layernorm(h))

    def ttt_weights(self, dtype: torch.dtype | None) -> dict[str, torch.Tensor] | None:
        """The seven projection weights cast to ``dtype`` once, for every TTT step of one forward (None: use the
        modules as they are). Under autocast over fp32 master weights each compiled step would otherwise cast
        (and keep for backward) its own bf16 copy: K copies of the layer, 3.4 GB at TTT 7 for a
        Llama-3.1-8B-shaped draft. The same bf16 values autocast uses; the K steps' gradients meet at the one
        cast, as under eager autocast's weight cache.

        Only plain ``nn.Linear`` layers get a copy: a layer replaced by a module with its own product (torchao's
        ``Float8Linear``, ``train.fp8``: :mod:`eyas.train.fp8`) runs through its forward, which casts its weight
        itself (to fp8, keeping only the fp32 parameter for backward)."""
        if dtype is None:
            return None
        a, m = self.self_attn, self.mlp
        layers = {"q": a.q_proj, "k": a.k_proj, "v": a.v_proj, "o": a.o_proj,
                  "gate": m.gate_proj, "up": m.up_proj, "down": m.down_proj}
        return {name: layer.weight.to(dtype) for name, layer in layers.items() if type(layer) is nn.Linear} or None

    def ttt_step(self, emb, hidden, cos, sin, ks: list, vs: list, num_steps: int, weights: dict | None = None):
        """Training: one TTT step. emb, hidden [B, T, H]; ``ks``/``vs`` earlier steps' keys/values; ``weights``
        from :meth:`ttt_weights`. Returns (new hidden [B, T, H] pre-norm, fed back as the next step's feature;
        k; v)."""
        q, k, v = self.ttt_in(emb, hidden, cos, sin, weights)
        o = ATTENTION[self.self_attn.backend](q, ks + [k], vs + [v], num_steps)      # [B, nh, T, hd]
        return self.ttt_out(o, hidden, weights), k, v

    def ttt_in(self, emb, hidden, cos, sin, weights: dict | None = None):
        """Norms, concat, q/k/v projections and RoPE: (q [B, nh, T, hd], k, v [B, nkv, T, hd]). Same shapes at
        every TTT step, so ``torch.compile`` of this method compiles once per sequence length."""
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
        return self.self_attn._qkv(x, cos, sin, weights)

    def ttt_out(self, o, hidden, weights: dict | None = None):
        """o_proj, residual on the raw feature, post-attention norm and MLP: [B, T, H]."""
        h = hidden + self.self_attn._out(o, weights)
        return h + self.mlp(self.post_attention_layernorm(h), weights)


class Eagle3StackedLayer(nn.Module):
    """``layers.i`` (i >= 1): a plain pre-norm Llama decoder layer on the H-wide residual stream, as vLLM runs the
    layers after the first (llama_eagle3.py ``LlamaDecoderLayer.forward`` with ``layer_idx > 0``). ``hidden_norm``
    is there only because vLLM builds one in every layer and requires every parameter from the checkpoint; it is
    unused and frozen at ones."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm.weight.requires_grad_(False)
        self.self_attn = Eagle3Attention(cfg, input_size=cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Eagle3MLP(cfg)

    def forward(self, hidden, cos, sin, kv: "KVCache", heads: slice) -> torch.Tensor:
        """Inference: hidden [B, S, H] (the previous layer's pre-norm output) -> [B, S, H]; ``kv``: the cache,
        this layer's key/value heads at ``heads`` (:meth:`Eagle3Attention.decode`)."""
        h = hidden + self.self_attn.decode(self.input_layernorm(hidden), cos, sin, kv, heads)
        return h + self.mlp(self.post_attention_layernorm(h))

    ttt_weights = Eagle3DecoderLayer.ttt_weights

    def ttt_step(self, hidden, cos, sin, ks: list, vs: list, num_steps: int, weights: dict | None = None):
        """Training: one TTT step of this layer; as :meth:`Eagle3DecoderLayer.ttt_step` without the embedding."""
        q, k, v = self.ttt_in(hidden, cos, sin, weights)
        o = ATTENTION[self.self_attn.backend](q, ks + [k], vs + [v], num_steps)      # [B, nh, T, hd]
        return self.ttt_out(o, hidden, weights), k, v

    def ttt_in(self, hidden, cos, sin, weights: dict | None = None):
        return self.self_attn._qkv(self.input_layernorm(hidden), cos, sin, weights)

    ttt_out = Eagle3DecoderLayer.ttt_out


class Eagle3DraftModel(nn.Module):
    """The EAGLE-3 drafter. Attribute names equal the served checkpoint's keys (export is a table)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(cfg.own_embedding)  # frozen copy of the target's when shared
        self.fc = nn.Linear(cfg.num_aux_layers * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(cfg)
        # layers.1 .. layers.{n-1}: vLLM's names for the stacked layers (ModuleDict keys, so the state dict's names
        # are the served checkpoint's; midlayer is vLLM's layers.0)
        self.layers = nn.ModuleDict({str(i): Eagle3StackedLayer(cfg) for i in range(1, cfg.num_hidden_layers)})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.gradient_checkpointing = False   # recompute each TTT step in backward (long sequences)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights an engine loads: everything but the RoPE tables and a shared ``embed_tokens``; plus d2t/t2d.
        A draft with its own embedding (:attr:`Eagle3Config.own_embedding`) includes ``embed_tokens.weight``."""
        own = self.config.own_embedding
        return {k: v for k, v in self.state_dict().items()
                if (own or not k.startswith("embed_tokens.")) and not k.startswith("rotary.")}

    def decoder_layers(self) -> list[nn.Module]:
        """midlayer, then the stacked layers in order."""
        return [self.midlayer, *self.layers.values()]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [.., Dv] from a pre-norm hidden state [.., H]."""
        return self.lm_head(self.norm(hidden))

    def forward(self, input_ids: torch.Tensor, aux: torch.Tensor, ttt_steps: int) -> list[torch.Tensor]:
        """Training-time test, unrolled.

        Args:
            input_ids: int64 [B, T] target token ids (right-padded).
            aux: [B, T, 3*Ht] concatenated aux hidden states of the target at the same positions.
            ttt_steps: K.
        Returns:
            K tensors [B, T, H]: step k's pre-norm hidden at position t, which predicts token t+2+k.
        """
        B, T = input_ids.shape
        hidden = self.fc(aux)                                    # [B, T, H]
        positions = torch.arange(T, device=input_ids.device)
        ids = _shift_left(input_ids)                             # step 0 embeds token t+1
        layers = self.decoder_layers()
        ks: list = [[] for _ in layers]                          # per layer, the keys of steps 0..k-1
        vs: list = [[] for _ in layers]
        outs = []
        weights = [layer.ttt_weights(_autocast_cast_dtype(layer.self_attn.q_proj.weight)) for layer in layers]
        recompute = self.gradient_checkpointing and torch.is_grad_enabled()
        for k in range(ttt_steps):
            cos, sin = self.rotary(positions + k)
            emb = self.embed_tokens(ids)                         # [B, T, H]
            for i, layer in enumerate(layers):
                args = ((emb,) if i == 0 else ()) + (hidden, cos, sin, ks[i], vs[i], ttt_steps, weights[i])
                if recompute:
                    hidden, key, value = checkpoint(layer.ttt_step, *args, use_reentrant=False)
                else:
                    hidden, key, value = layer.ttt_step(*args)
                ks[i], vs[i] = ks[i] + [key], vs[i] + [value]
            outs.append(hidden)
            ids = _shift_left(ids)                               # step k+1 embeds token t+2+k
        return outs

    def set_attention(self, backend: str) -> None:
        """Choose the TTT attention kernel by name (a key of :data:`eyas.model.attention.ATTENTION`).

        Raises ``KeyError`` for an unknown name."""
        if backend not in ATTENTION:
            raise KeyError(f"unknown attention backend {backend!r}; known: {sorted(ATTENTION)}")
        for layer in self.decoder_layers():
            layer.self_attn.backend = backend

    def compile_ttt(self) -> None:
        """``torch.compile`` the per-step parts around attention (:meth:`Eagle3DecoderLayer.ttt_in` and
        ``ttt_out``): norms, RoPE and the MLP's elementwise work fuse; attention keeps its own kernel. The module
        tree and state dict are unchanged."""
        for layer in self.decoder_layers():
            layer.ttt_in = torch.compile(layer.ttt_in)
            layer.ttt_out = torch.compile(layer.ttt_out)

    def decode_step(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                    kv: KVCache, from_target: bool) -> torch.Tensor:
        """Inference. input_ids [B, S]; hidden [B, S, 3*Ht] target aux states (``from_target``: fused by fc) or
        [B, S, H] the draft's own pre-norm features; positions [S]. Appends S entries to ``kv``; returns the
        pre-norm hidden [B, S, H]."""
        if from_target:
            hidden = self.fc(hidden)
        cos, sin = self.rotary(positions)
        nkv = self.config.num_key_value_heads
        hidden = self.midlayer(self.embed_tokens(input_ids), hidden, cos, sin, kv, slice(0, nkv))
        for i, layer in enumerate(self.layers.values(), start=1):
            hidden = layer(hidden, cos, sin, kv, slice(i * nkv, (i + 1) * nkv))
        kv.commit()
        return hidden


def widen_mlp(model: Eagle3DraftModel, intermediate_size: int, seed: int = 0) -> Eagle3DraftModel:
    """A copy of ``model`` whose SwiGLU MLP has ``intermediate_size`` channels, computing the same function.

    The old channels keep their weights; each new channel gets gate/up rows drawn as ``nn.Linear`` draws them
    (uniform in +-1/sqrt(H), seeded) and a down_proj column of zeros, so the widened draft's outputs equal the
    original's exactly until training moves the new columns (Net2WiderNet, arXiv 1511.05641, with a zero
    output map). Used by ``train.init_from`` with a larger ``train.draft.intermediate_size``: more capacity,
    started from what a drafter already knows. Engines read the width from config.json (``intermediate_size``).

    Raises ``ValueError`` when ``intermediate_size`` is smaller than the model's."""
    old = model.config
    if intermediate_size < old.intermediate_size:
        raise ValueError(f"intermediate_size {intermediate_size} is smaller than the drafter's "
                         f"{old.intermediate_size}: a drafter can be widened, not narrowed")
    wide = Eagle3DraftModel(replace(old, intermediate_size=intermediate_size))
    state = model.state_dict()
    gen = torch.Generator().manual_seed(seed)
    extra, H = intermediate_size - old.intermediate_size, old.hidden_size
    mlp = "midlayer.mlp."
    for name in ("gate_proj", "up_proj"):
        w = state[f"{mlp}{name}.weight"]
        new = (torch.rand(extra, H, generator=gen, dtype=torch.float32) * 2 - 1) / H ** 0.5
        state[f"{mlp}{name}.weight"] = torch.cat([w, new.to(w.dtype)], dim=0)
    down = state[f"{mlp}down_proj.weight"]
    state[f"{mlp}down_proj.weight"] = torch.cat([down, down.new_zeros(H, extra)], dim=1)
    wide.load_state_dict(state)   # embed_tokens' requires_grad follows the config (own_embedding), as before
    return wide.train(model.training)


def deepen(model: Eagle3DraftModel, num_hidden_layers: int, seed: int = 0) -> Eagle3DraftModel:
    """A copy of ``model`` with ``num_hidden_layers`` decoder layers, computing the same function.

    The drafter's layers keep their weights; each new stacked layer (:class:`Eagle3StackedLayer`, appended after
    the last) gets q/k/v and gate/up weights drawn as ``nn.Linear`` draws them (seeded) and an ``o_proj`` and
    ``down_proj`` of zeros, so it adds nothing to the residual stream and the deeper draft's outputs equal the
    original's exactly until training moves those two (a zero-initialised residual branch, as ``widen_mlp``).
    Used by ``train.init_from`` with a larger ``train.draft.num_hidden_layers``: more sequential computation per
    drafted token, started from what a drafter already knows. vLLM loads it (``num_hidden_layers`` in config.json);
    SGLang's llama_eagle3.py raises on more than one layer.

    Raises ``ValueError`` when ``num_hidden_layers`` is smaller than the model's."""
    old = model.config
    if num_hidden_layers < old.num_hidden_layers:
        raise ValueError(f"num_hidden_layers {num_hidden_layers} is smaller than the drafter's "
                         f"{old.num_hidden_layers}: layers can be added, not removed")
    deep = Eagle3DraftModel(replace(old, num_hidden_layers=num_hidden_layers))
    state = deep.state_dict()
    state.update(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    for i in range(old.num_hidden_layers, num_hidden_layers):
        for name, w in deep.layers[str(i)].state_dict().items():
            key = f"layers.{i}.{name}"
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                state[key] = torch.zeros_like(w)
            elif name.endswith("proj.weight"):
                bound = 1 / w.shape[1] ** 0.5
                state[key] = ((torch.rand(w.shape, generator=gen) * 2 - 1) * bound).to(w.dtype)
    deep.load_state_dict(state)
    deep.gradient_checkpointing = model.gradient_checkpointing
    return deep.train(model.training)


@dataclass
class VocabRemap:
    """What :func:`remap_draft_vocab` did: rows of the new draft vocabulary ``kept`` from the drafter, ``new``
    (started from the fit), the drafter's ids ``dropped``, and the fit's mean cosine between predicted and actual
    rows of kept ids it was not fitted on (``fit_cosine``: how well the target's rows predict the drafter's)."""

    kept: int
    new: int
    dropped: int
    fit_cosine: float


def remap_draft_vocab(model: Eagle3DraftModel, d2t: torch.Tensor, t2d: torch.Tensor, target_lm_head: torch.Tensor,
                      ridge: float = 1e-3) -> tuple[Eagle3DraftModel, VocabRemap]:
    """A copy of ``model`` predicting over another draft vocabulary (``d2t`` int64 [D'], ``t2d`` bool [V]).

    Every weight but the draft ``lm_head`` is kept. A row of the new ``lm_head`` [D', H] whose target id the
    drafter already predicts is that drafter's row, so those ids keep their logits exactly; a row of a new id starts
    from the target's own ``lm_head`` row [Ht] mapped into the draft's head by a ridge least-squares fit
    ``[target_row, 1] @ W ~ draft_row`` (float64, ``W`` [Ht+1, H]) over the ids in both vocabularies: the drafter's
    head is a learnt copy of the target's (EAGLE-3 trains it on the target's distribution), so the fit gives a new id
    a row pointing where the drafter would have put it; training then moves it. Used by ``train.init_from`` with
    ``train.init_vocab: run``: a drafter whose vocabulary was chosen on other data (ids outside it are certain
    rejections in decoding) fine-tuned onto the run's vocabulary without starting over.

    Raises ``ValueError`` when the vocabularies share fewer ids than the fit has unknowns (Ht + 1) or the target
    vocabulary differs."""
    old = model.config
    if len(t2d) != old.vocab_size or target_lm_head.shape[0] != old.vocab_size:
        raise ValueError(f"the new draft vocabulary is over {len(t2d)} target ids and the target head has "
                         f"{target_lm_head.shape[0]} rows; the drafter's target has {old.vocab_size}")
    new_ids = draft_to_target_ids(d2t)
    old_ids = draft_to_target_ids(model.d2t.cpu())
    row_of = torch.full((old.vocab_size,), -1, dtype=torch.long)
    row_of[old_ids] = torch.arange(len(old_ids))
    src = row_of[new_ids]                                      # the drafter's row of each new id, -1 if none
    kept = src >= 0
    H1 = target_lm_head.shape[1] + 1
    if int(kept.sum()) < H1:
        raise ValueError(f"the drafter's vocabulary and the new one share {int(kept.sum())} ids; fitting rows for "
                         f"new ids needs at least {H1} (the target's hidden size + 1)")
    head = model.lm_head.weight.detach().cpu()
    X = torch.cat([target_lm_head.detach().cpu().double(), torch.ones(old.vocab_size, 1, dtype=torch.float64)], 1)
    Xk, Yk = X[new_ids[kept]], head[src[kept]].double()
    # fit quality on held-out kept rows (every 10th), then the fit on all of them
    test = torch.zeros(len(Xk), dtype=torch.bool)
    test[::10] = True

    def fit(A, B):
        return torch.linalg.solve(A.T @ A + ridge * torch.eye(H1, dtype=A.dtype), A.T @ B)

    pred = Xk[test] @ fit(Xk[~test], Yk[~test])
    cosine = float(torch.nn.functional.cosine_similarity(pred, Yk[test], dim=1).mean())
    rows = (X[new_ids] @ fit(Xk, Yk)).to(head.dtype)
    rows[kept] = head[src[kept]]
    out = Eagle3DraftModel(replace(old, draft_vocab_size=len(d2t)))
    state = {k: v for k, v in model.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    state.update({"lm_head.weight": rows, "d2t": d2t.clone(), "t2d": t2d.clone()})
    out.load_state_dict(state)
    out.gradient_checkpointing = model.gradient_checkpointing
    return out.train(model.training), VocabRemap(kept=int(kept.sum()), new=int((~kept).sum()),
                                                 dropped=len(old_ids) - int(kept.sum()), fit_cosine=round(cosine, 4))


def _autocast_cast_dtype(weight: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would cast this fp32 weight to in a matrix product on its device, or None (autocast off,
    or the weight not fp32: bf16 weights, or FSDP's bf16 mixed precision, need no cast)."""
    device = weight.device.type
    if weight.dtype != torch.float32 or not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


def _shift_left(ids: torch.Tensor) -> torch.Tensor:
    """ids[:, t] <- ids[:, t+1]; the last column becomes 0 (its positions are masked out of the loss)."""
    return torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)

"""In-process generation at GPU speed: continuous batching over a static KV cache, the decode step replayed as a
CUDA graph, and a decode-attention kernel that reads only each row's own keys.

Why: decoding a small or medium target is launch-bound and, at large batch, bound by reading the KV cache.
transformers' ``generate`` pads a batch to its longest prompt, keeps every row until the longest reply ends, and
launches every kernel from Python each step (BENCHMARKS.md, issue 11: 4,400-5,100 new tokens/s inside the old stage
against 22,000-70,000 for ``generate`` alone at batch 512-2,048). This engine keeps ``B`` slots busy:

- **Slots and a static cache.** ``k_cache``/``v_cache`` [layers, B, nkv, L, hd] in the model dtype; slot b holds one
  request (a prompt and its reply so far). When a request finishes (end-of-turn token or its token limit) its slot
  is handed out again at the next refill, so no row waits for the longest reply of its batch.
- **Prefill** of newly admitted requests runs eagerly, several prompts at once (sorted by length, right-padded, a
  token budget per pass), and writes their keys/values into their slots; the last position's logits give each
  request its first new token.
- **Decode** advances every slot by one token per step. ``steps_per_graph`` steps are captured once as one CUDA
  graph and replayed (no Python and no kernel-launch gaps inside), the host looks at the slots once per replay (one
  small device-to-host copy) to collect finished requests and refill.
- **Decode attention** (``attention="triton"``, CUDA): one program per (slot, key/value head) streams only the
  slot's own ``pos + 1`` keys (online softmax, the query heads of a GQA group as the rows of one tile), so the cost
  follows the real context, not ``L``. ``attention="sdpa"`` (CPU, and the fallback) masks the whole ``L`` keys; both
  compute the same function, checked against each other when the engine starts on a GPU.

The forward pass is transformers' own modules for everything but attention (norms, projections, MLP, RoPE tables
from the model's ``rotary_emb``), so numerics follow the model's code; attention is ``softmax(q k^T / sqrt(hd)) v``
over positions ``<= pos``, as ``LlamaAttention`` computes it (transformers ``models/llama/modeling_llama.py``).
Supported: decoder-only models with global attention, RoPE and the Llama/Qwen layer layout (``llama`` (SmolLM2),
``qwen2``, ``qwen3``, ``mistral`` without a sliding window); :func:`unsupported_reason` says why another model is
not, and the generate stage then falls back to ``model.generate``.

Shape legend: B slots, L cache length (prompt + new tokens), nh/nkv query/key-value heads, G = nh // nkv, hd head
dim, H hidden size, V vocabulary.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
_SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn")  # position-independent tables (not dynamic/longrope)


@dataclass
class GenRequest:
    """One prompt to continue. ``key`` is the caller's handle, returned with the result."""

    key: object
    prompt_ids: Sequence[int]
    max_new_tokens: int


@dataclass
class GenResult:
    """A finished request: ``token_ids`` are the new tokens without the stop token; ``finish`` is ``"stop"`` (the
    model emitted ``stop_token``, one of the end ids) or ``"length"`` (``max_new_tokens`` reached)."""

    key: object
    token_ids: list[int]
    finish: str
    stop_token: int | None


@dataclass
class EngineStats:
    """Counters of one :meth:`SlotEngine.run`: requests, new tokens, prefill tokens (real, unpadded), decode steps
    (each advances every slot), seconds, and which attention / graph path ran."""

    requests: int = 0
    new_tokens: int = 0
    prefill_tokens: int = 0
    decode_steps: int = 0
    seconds: float = 0.0
    slots: int = 0
    cache_len: int = 0
    attention: str = ""
    cuda_graph: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def new_tokens_per_s(self) -> float:
        return self.new_tokens / max(self.seconds, 1e-9)


def unsupported_reason(model) -> str | None:
    """``None`` when :class:`SlotEngine` can run ``model`` (a transformers ``*ForCausalLM``), else why not."""
    cfg = getattr(model, "config", None)
    mt = getattr(cfg, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        return f"model_type {mt!r} (the fast path covers {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", mt == "mistral"):
        return "sliding-window attention"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return "layers other than full attention"
    rope = (getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    rtype = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rtype not in _SUPPORTED_ROPE:
        return f"rope type {rtype!r}"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "no model.model.layers / rotary_emb"
    return None


# ----------------------------------------------------------------------------------------------- decode attention
def decode_attention_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          klen: torch.Tensor) -> torch.Tensor:
    """Reference decode attention. q [B, nh, hd]; k_cache/v_cache [B, nkv, L, hd]; klen int [B] (keys 0..klen-1
    are attended, klen >= 1). Returns [B, nh, hd]. The G query heads of a group are the rows of one SDPA query, so
    no key/value head is repeated; all L keys are read."""
    B, nh, hd = q.shape
    nkv, L = k_cache.shape[1], k_cache.shape[2]
    qg = q.view(B, nkv, nh // nkv, hd)                                              # [B, nkv, G, hd]
    mask = torch.arange(L, device=q.device).view(1, 1, 1, L) < klen.view(B, 1, 1, 1)
    o = F.scaled_dot_product_attention(qg, k_cache, v_cache, attn_mask=mask)        # [B, nkv, G, hd]
    return o.reshape(B, nh, hd)


_TRITON_KERNEL = None


def _triton_kernel():
    """The Triton decode kernel, compiled lazily (``None`` when Triton is not importable)."""
    global _TRITON_KERNEL
    if _TRITON_KERNEL is not None:
        return _TRITON_KERNEL
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def kernel(Q, K, V, O, KLEN, sqb, sqh, skb, skh, skl, svb, svh, svl, sob, soh, scale,
               G: tl.constexpr, G_PAD: tl.constexpr, HD: tl.constexpr, BLOCK_N: tl.constexpr,
               PREC: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        n_keys = tl.load(KLEN + b)
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, HD)
        heads = kvh * G + offs_g
        qmask = offs_g < G
        q = tl.load(Q + b * sqb + heads[:, None] * sqh + offs_d[None, :], mask=qmask[:, None], other=0.0)
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, HD], tl.float32)
        k_base = K + b * skb + kvh * skh
        v_base = V + b * svb + kvh * svh
        for start in range(0, n_keys, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            nmask = offs_n < n_keys
            k = tl.load(k_base + offs_n[:, None] * skl + offs_d[None, :], mask=nmask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale               # [G_PAD, BLOCK_N] fp32
            s = tl.where(nmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + offs_n[:, None] * svl + offs_d[None, :], mask=nmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(O + b * sob + heads[:, None] * soh + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=qmask[:, None])

    _TRITON_KERNEL = kernel
    return kernel


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            klen: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`decode_attention_sdpa` (CUDA, hd a power of two); reads only ``klen[b]`` keys of
    slot b. Raises ``RuntimeError`` when Triton is missing."""
    kernel = _triton_kernel()
    if kernel is None:
        raise RuntimeError("triton is not installed")
    B, nh, hd = q.shape
    nkv = k_cache.shape[1]
    G = nh // nkv
    q = q.contiguous()
    o = torch.empty_like(q)
    kernel[(B, nkv)](q, k_cache, v_cache, o, klen, q.stride(0), q.stride(1),
                     k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                     v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), o.stride(0), o.stride(1),
                     1.0 / math.sqrt(hd), G=G, G_PAD=max(16, triton_next_pow2(G)), HD=hd, BLOCK_N=64,
                     PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, num_stages=2)
    return o


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


ATTENTION = {"sdpa": decode_attention_sdpa, "triton": decode_attention_triton}


# ------------------------------------------------------------------------------------------------------- the engine
class SlotEngine:
    """Continuous-batching greedy (or sampled) generation for one transformers causal LM on one device.

    Args:
        model: a ``*ForCausalLM`` in eval mode, supported per :func:`unsupported_reason` (else ``ValueError``).
        slots: B, requests decoded at once; lowered to what the free device memory holds for ``cache_len``.
        cache_len: L, the most tokens (prompt + reply) one slot holds; capped at ``max_position_embeddings``.
        max_new_tokens: the largest reply limit of any request (sizes the per-slot token buffer).
        eos_ids: token ids that end a reply (the target's end-of-turn tokens).
        temperature: 0 = greedy (argmax); > 0 samples (Gumbel-max) after ``top_p`` filtering.
        steps_per_graph: decode steps per host check (and per CUDA graph replay).
        attention: ``"auto"`` (Triton on CUDA when it matches the SDPA reference, else SDPA), ``"triton"``, ``"sdpa"``.
        cuda_graph: capture the decode steps as a CUDA graph (CUDA only; falls back to eager, with a note, when
            capture fails).
        prefill_tokens: padded tokens per prefill pass.
        log: where notes go (chosen slots, fallbacks).
    """

    def __init__(self, model, *, slots: int, cache_len: int, max_new_tokens: int, eos_ids: Sequence[int],
                 temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, steps_per_graph: int = 8, attention: str = "auto",
                 cuda_graph: bool = True, prefill_tokens: int = 32768, memory_fraction: float = 0.85,
                 log: Callable[[str], None] = print):
        why = unsupported_reason(model)
        if why:
            raise ValueError(f"SlotEngine does not support this model: {why}")
        self.model, self.log = model, log
        cfg = model.config
        inner = model.model
        self.layers = list(inner.layers)
        self.embed, self.norm, self.lm_head = inner.embed_tokens, inner.norm, model.lm_head
        self.device = self.embed.weight.device
        self.dtype = self.embed.weight.dtype
        self.nh = int(cfg.num_attention_heads)
        self.nkv = int(getattr(cfg, "num_key_value_heads", None) or self.nh)
        self.hd = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh)
        self.L = int(min(cache_len, getattr(cfg, "max_position_embeddings", cache_len) or cache_len))
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.steps_per_graph = max(1, int(steps_per_graph))
        self.prefill_tokens = max(int(prefill_tokens), self.L)
        self.stats = EngineStats()
        self.B = self._fit_slots(int(slots), memory_fraction)
        self.stats.slots, self.stats.cache_len = self.B, self.L
        dev, B, L, n = self.device, self.B, self.L, len(self.layers)
        # zeros, never uninitialised memory: a masked key still multiplies its value by 0 in SDPA, and 0 * NaN = NaN
        self.k_cache = torch.zeros(n, B, self.nkv, L, self.hd, dtype=self.dtype, device=dev)
        self.v_cache = torch.zeros(n, B, self.nkv, L, self.hd, dtype=self.dtype, device=dev)
        pos_all = torch.arange(L, device=dev).view(1, L)
        cos, sin = inner.rotary_emb(self.k_cache[0, :1, 0, :1], pos_all)              # [1, L, hd] model dtype
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()
        self.eos = torch.tensor(sorted(set(int(e) for e in eos_ids)) or [-1], dtype=torch.long, device=dev)
        # per-slot state, read and written by the (captured) decode step
        self.tok = torch.zeros(B, dtype=torch.long, device=dev)          # input token of the next step
        self.pos = torch.zeros(B, dtype=torch.long, device=dev)          # its position (= cache row it writes)
        self.active = torch.zeros(B, dtype=torch.bool, device=dev)       # decoding (not free, not finished)
        self.count = torch.zeros(B, dtype=torch.long, device=dev)        # new tokens so far
        self.limit = torch.ones(B, dtype=torch.long, device=dev)         # max new tokens of the slot's request
        self.stopped = torch.zeros(B, dtype=torch.bool, device=dev)      # ended by an end id (not length)
        self.out = torch.zeros(B, max_new_tokens + 1, dtype=torch.long, device=dev)  # new tokens of each slot
        if temperature > 0:
            torch.manual_seed(seed)
            if dev.type == "cuda":
                torch.cuda.manual_seed(seed)
        self.attention = self._choose_attention(attention)
        self.use_graph = cuda_graph and dev.type == "cuda"
        self.graph: torch.cuda.CUDAGraph | None = None
        self._capturing = False
        self.stats.attention = self.attention

    # ------------------------------------------------------------------------------------------------ set-up
    def _slot_bytes(self) -> int:
        return 2 * len(self.layers) * self.nkv * self.L * self.hd * self.dtype.itemsize

    def _fit_slots(self, slots: int, fraction: float) -> int:
        """``slots``, lowered to what ``fraction`` of the free GPU memory holds after the prefill's activations and
        the decode step's logits are set aside (no limit on the CPU)."""
        if self.device.type != "cuda":
            return max(1, slots)
        free, _ = torch.cuda.mem_get_info(self.device)
        cfg = self.model.config
        V, H = int(self.lm_head.weight.shape[0]), int(cfg.hidden_size)
        inter = int(getattr(cfg, "intermediate_size", 4 * H))
        reserve = self.prefill_tokens * (6 * H + 3 * inter) * 4 + 4 * slots * V * 4 + (2 << 30)
        fit = int((free * fraction - reserve) // self._slot_bytes())
        if fit < 1:
            raise RuntimeError(f"not enough GPU memory for one slot of {self.L} tokens "
                               f"({self._slot_bytes() / 2**20:.0f} MiB; {free / 2**30:.1f} GiB free)")
        if fit < slots:
            self.stats.notes.append(f"slots lowered from {slots} to {fit} (KV cache of {self.L} tokens per slot, "
                                    f"{free / 2**30:.0f} GiB free)")
            self.log(f"[eyas] generate: {self.stats.notes[-1]}")
        return min(slots, fit)

    def _choose_attention(self, want: str) -> str:
        if want == "sdpa" or (want == "auto" and self.device.type != "cuda"):
            return "sdpa"
        reason = None
        if self.device.type != "cuda":
            reason = "triton decode attention needs CUDA"
        elif self.hd & (self.hd - 1):
            reason = f"head dim {self.hd} is not a power of two"
        elif _triton_kernel() is None:
            reason = "triton is not installed"
        else:
            try:
                err = self._check_triton()
                if err > 2e-2:
                    reason = f"triton decode attention differs from SDPA (relative error {err:.2e})"
            except Exception as e:  # noqa: BLE001 - any compile/launch failure means: use the reference
                reason = f"triton decode attention failed ({type(e).__name__}: {e})"
        if reason is None:
            return "triton"
        if want == "triton":
            raise RuntimeError(reason)
        self.stats.notes.append(f"attention sdpa: {reason}")
        self.log(f"[eyas] generate: {self.stats.notes[-1]}")
        return "sdpa"

    @torch.no_grad()
    def _check_triton(self) -> float:
        """Relative error of the Triton kernel against the SDPA reference on random inputs and lengths."""
        g = torch.Generator(device=self.device).manual_seed(1234)
        B, L = 37, min(self.L, 700)
        q = torch.randn(B, self.nh, self.hd, device=self.device, generator=g).to(self.dtype)
        k = torch.randn(B, self.nkv, L, self.hd, device=self.device, generator=g).to(self.dtype)
        v = torch.randn(B, self.nkv, L, self.hd, device=self.device, generator=g).to(self.dtype)
        klen = torch.randint(1, L + 1, (B,), device=self.device, generator=g)
        ref = decode_attention_sdpa(q.float(), k.float(), v.float(), klen)
        got = decode_attention_triton(q, k, v, klen).float()
        return float((got - ref).norm() / ref.norm())

    # ------------------------------------------------------------------------------------------ forward parts
    def _qkv(self, layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h [N, T, H] -> q [N, nh, T, hd], k/v [N, nkv, T, hd] with q/k norms (Qwen3) and RoPE (cos/sin [.., T, hd])."""
        att = layer.self_attn
        N, T, _ = h.shape
        q = att.q_proj(h).view(N, T, -1, self.hd)
        k = att.k_proj(h).view(N, T, -1, self.hd)
        v = att.v_proj(h).view(N, T, -1, self.hd).transpose(1, 2)
        if hasattr(att, "q_norm"):
            q, k = att.q_norm(q), att.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    @torch.no_grad()
    def _prefill(self, slot_ids: list[int], prompts: list[Sequence[int]]) -> torch.Tensor:
        """Prefill ``prompts`` into ``slot_ids`` (one right-padded pass); returns the first new token of each [n]."""
        n, T = len(prompts), max(len(p) for p in prompts)
        dev = self.device
        ids = torch.zeros(n, T, dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=dev)
        ids = ids.to(dev, non_blocking=True)
        slots = torch.tensor(slot_ids, dtype=torch.long, device=dev)
        x = self.embed(ids)                                                            # [n, T, H]
        cos, sin = self.cos[:T].unsqueeze(0), self.sin[:T].unsqueeze(0)                # [1, T, hd]
        for li, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            q, k, v = self._qkv(layer, h, cos, sin)
            self.k_cache[li, slots, :, :T] = k
            self.v_cache[li, slots, :, :T] = v
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.nh != self.nkv)
            x = x + layer.self_attn.o_proj(o.transpose(1, 2).reshape(n, T, self.nh * self.hd))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        last = x[torch.arange(n, device=dev), lens - 1]                                # [n, H]
        logits = self.lm_head(self.norm(last))                                         # [n, V]
        self.stats.prefill_tokens += int(sum(len(p) for p in prompts))
        return self._pick(logits), lens

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        """Next token from logits [N, V]: argmax, or a sample at ``temperature`` after ``top_p`` filtering."""
        if self.temperature <= 0:
            return logits.argmax(-1)
        lg = logits.float() / self.temperature
        if self.top_p < 1.0:
            srt, idx = lg.sort(-1, descending=True)
            probs = srt.softmax(-1)
            drop = probs.cumsum(-1) - probs > self.top_p                               # keeps the first always
            lg = lg.scatter(-1, idx, srt.masked_fill(drop, float("-inf")))
        u = torch.rand(lg.shape, device=lg.device).clamp_(min=1e-20)
        return (lg - torch.log(-torch.log(u))).argmax(-1)

    def _step(self) -> None:
        """One decode step of every slot, updating the persistent state tensors in place (so the same code runs
        eagerly and inside the captured CUDA graph)."""
        B = self.B
        attn = ATTENTION[self.attention]
        act = self.active.clone()
        klen = torch.where(act, self.pos + 1, torch.ones_like(self.pos))               # free slots read 1 key
        keys = self.L
        if self.graph is None and not self._capturing:   # eager (CPU): read only up to the longest row's keys
            keys = int(klen.max())
        rows = torch.arange(B, device=self.device)
        x = self.embed(self.tok).unsqueeze(1)                                          # [B, 1, H]
        cos, sin = self.cos[self.pos].unsqueeze(1), self.sin[self.pos].unsqueeze(1)    # [B, 1, hd]
        for li, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            q, k, v = self._qkv(layer, h, cos, sin)                                    # q [B, nh, 1, hd]
            self.k_cache[li, rows, :, self.pos] = k[:, :, 0]
            self.v_cache[li, rows, :, self.pos] = v[:, :, 0]
            o = attn(q[:, :, 0], self.k_cache[li, :, :, :keys], self.v_cache[li, :, :, :keys], klen)  # [B, nh, hd]
            x = x + layer.self_attn.o_proj(o.reshape(B, 1, self.nh * self.hd))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        nxt = self._pick(self.lm_head(self.norm(x[:, 0])))                             # [B]
        self.out.scatter_(1, self.count.view(B, 1), torch.where(act, nxt, 0).view(B, 1))
        self.count += act.long()
        hit_end = (nxt.view(B, 1) == self.eos.view(1, -1)).any(1) & act
        self.stopped |= hit_end
        self.active &= ~(hit_end | (self.count >= self.limit))
        self.tok.copy_(torch.where(self.active, nxt, self.tok))
        self.pos += self.active.long()

    def _decode(self) -> None:
        """``steps_per_graph`` decode steps: a CUDA graph replay when captured, else eager."""
        if self.use_graph and self.graph is None:
            self._capture()
        if self.graph is not None:
            self.graph.replay()
        else:
            for _ in range(self.steps_per_graph):
                self._step()
        self.stats.decode_steps += self.steps_per_graph

    def _state(self) -> list[torch.Tensor]:
        return [self.tok, self.pos, self.active, self.count, self.limit, self.stopped, self.out]

    def _capture(self) -> None:
        """Record ``steps_per_graph`` decode steps as one CUDA graph (after two eager warm-up steps on a side stream,
        which compile the Triton kernel and create library handles outside the capture). Called while every slot
        is free; the state the warm-up changed is restored."""
        saved = [t.clone() for t in self._state()]
        try:
            cur = torch.cuda.current_stream(self.device)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(cur)
            self._capturing = True
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._step()
            cur.wait_stream(side)
            for t, v in zip(self._state(), saved):
                t.copy_(v)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(self.steps_per_graph):
                    self._step()
            self.graph = g
            self._capturing = False
            self.stats.cuda_graph = True
        except Exception as e:  # noqa: BLE001 - eager decoding computes the same tokens
            self.use_graph, self.graph = False, None
            self._capturing = False
            self.stats.notes.append(f"CUDA graph capture failed ({type(e).__name__}: {e}); decoding eagerly")
            self.log(f"[eyas] generate: {self.stats.notes[-1]}")
        for t, v in zip(self._state(), saved):
            t.copy_(v)

    # ------------------------------------------------------------------------------------------------ the loop
    @torch.no_grad()
    def run(self, feed: Callable[[int], list[GenRequest]], on_result: Callable[[GenResult], None]) -> EngineStats:
        """Generate until ``feed`` has nothing more and every slot is free; returns the counters.

        ``feed(n)`` returns up to ``n`` requests ready now (fewer, or none while results are pending: a multi-turn
        conversation's next turn becomes ready when its previous one comes back through ``on_result``, which is
        called once per request as soon as the host sees it finished). A prompt of ``L`` tokens or more raises
        ``ValueError`` (callers filter with ``generate.max_prompt_tokens``); a request whose prompt plus limit
        exceeds ``L`` (or the engine's ``max_new_tokens``) gets its limit lowered to fit (finish ``"length"``).
        """
        t0 = time.time()
        B = self.B
        if self.use_graph and self.graph is None:
            self._capture()
        keys: list[object] = [None] * B
        free = list(range(B - 1, -1, -1))
        running = 0
        refill_at = max(1, B // 16)                     # refill in groups: a prefill pass per few free slots
        while True:
            if free and (len(free) >= refill_at or running == 0):
                new = feed(len(free))
                if new:
                    self._admit(new, free, keys)
                    running += len(new)
            if running == 0:
                break
            self._decode()
            fin = (~self.active).tolist()                                              # the one sync per replay
            done = [b for b in range(B) if fin[b] and keys[b] is not None]
            if done:
                running -= len(done)
                self._harvest(done, keys, on_result)
                free.extend(done)
        self.stats.seconds += time.time() - t0
        return self.stats

    def _admit(self, reqs: list[GenRequest], free: list[int], keys: list) -> None:
        """Prefill ``reqs`` into free slots (passes of at most ``prefill_tokens`` padded tokens, by length)."""
        order = sorted(range(len(reqs)), key=lambda i: len(reqs[i].prompt_ids))
        groups: list[list[int]] = []
        for i in order:
            n = len(reqs[i].prompt_ids)
            if n < 1 or n >= self.L:
                raise ValueError(f"prompt of {n} tokens does not fit a cache of {self.L} tokens with room to reply")
            if groups and n * (len(groups[-1]) + 1) <= self.prefill_tokens:
                groups[-1].append(i)
            else:
                groups.append([i])
        cap = self.out.shape[1] - 1
        for grp in groups:
            slots = [free.pop() for _ in grp]
            first, lens = self._prefill(slots, [reqs[i].prompt_ids for i in grp])
            limit = torch.tensor([max(1, min(reqs[i].max_new_tokens, cap, self.L - len(reqs[i].prompt_ids)))
                                  for i in grp], dtype=torch.long, device=self.device)
            s = torch.tensor(slots, dtype=torch.long, device=self.device)
            ended = torch.isin(first, self.eos)
            self.out[s, 0] = first
            self.count[s] = 1
            self.limit[s] = limit
            self.stopped[s] = ended
            self.active[s] = ~ended & (limit > 1)
            self.tok[s] = first
            self.pos[s] = lens
            for b, i in zip(slots, grp):
                keys[b] = reqs[i]
        self.stats.requests += len(reqs)

    def _harvest(self, done: list[int], keys: list, on_result: Callable[[GenResult], None]) -> None:
        idx = torch.tensor(done, dtype=torch.long, device=self.device)
        counts = self.count[idx].tolist()
        stopped = self.stopped[idx].tolist()
        rows = self.out[idx, : max(counts)].tolist()
        for b, n, st, row in zip(done, counts, stopped, rows):
            req: GenRequest = keys[b]
            keys[b] = None
            toks = row[:n]
            self.stats.new_tokens += n
            if st:
                on_result(GenResult(req.key, toks[:-1], "stop", toks[-1]))
            else:
                on_result(GenResult(req.key, toks, "length", None))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)

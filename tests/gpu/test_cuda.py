"""GPU-only checks (skipped without CUDA; run on the H200 by bench/headline.sh): the Triton decode-attention kernel
against SDPA, and the generation engine with its CUDA graph and Triton kernel against transformers' own greedy
decoding (fp32, so the tokens must be identical)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("nh,nkv,hd", [(9, 3, 64), (32, 8, 128), (4, 4, 32)])
def test_triton_decode_attention_matches_sdpa(dtype, tol, nh, nkv, hd):
    from eyas.generation.engine import decode_attention_sdpa, decode_attention_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    B, L = 53, 1100
    q = torch.randn(B, nh, hd, device="cuda", generator=g).to(dtype)
    k = torch.randn(B, nkv, L, hd, device="cuda", generator=g).to(dtype)
    v = torch.randn(B, nkv, L, hd, device="cuda", generator=g).to(dtype)
    klen = torch.randint(1, L + 1, (B,), device="cuda", generator=g)
    klen[0], klen[1] = 1, L
    ref = decode_attention_sdpa(q.double(), k.double(), v.double(), klen)
    out = torch.full_like(q, float("nan"))
    out.copy_(decode_attention_triton(q, k, v, klen))
    assert torch.isfinite(out).all()
    assert float((out.double() - ref).norm() / ref.norm()) < tol


def _tiny(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[kind]
    torch.manual_seed(0)
    cfg = cls[0](hidden_size=64, intermediate_size=129, num_hidden_layers=3, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=16, vocab_size=211, max_position_embeddings=512,
                 tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = cls[1](cfg).eval().cuda()
    model.generation_config.eos_token_id = None     # no end token: every reply is max_new_tokens long
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_engine_with_graph_and_triton_equals_generate(kind):
    from eyas.generation.engine import GenRequest, SlotEngine

    model = _tiny(kind)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 211, (n,), generator=g).tolist() for n in [5, 70, 1, 130, 33, 9, 250, 17, 64, 2]]
    ref = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=40, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    eng = SlotEngine(model, slots=4, cache_len=320, max_new_tokens=40, eos_ids=[], steps_per_graph=8)
    assert eng.attention == "triton", eng.stats.notes
    queue = [GenRequest(i, p, 40) for i, p in enumerate(prompts)]
    got = {}
    eng.run(lambda n: [queue.pop(0) for _ in range(min(n, len(queue)))], lambda r: got.__setitem__(r.key, r))
    assert eng.stats.cuda_graph, eng.stats.notes
    assert [got[i].token_ids for i in range(len(prompts))] == ref


def test_engine_bf16_graph_agrees_with_eager_sdpa():
    from eyas.generation.engine import GenRequest, SlotEngine

    model = _tiny("llama").to(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 211, (int(n),), generator=g).tolist() for n in torch.randint(1, 200, (40,))]

    def run(**kw):
        eng = SlotEngine(model, slots=16, cache_len=300, max_new_tokens=48, eos_ids=[], **kw)
        q = [GenRequest(i, p, 48) for i, p in enumerate(prompts)]
        got = {}
        eng.run(lambda n: [q.pop(0) for _ in range(min(n, len(q)))], lambda r: got.__setitem__(r.key, r))
        return [got[i].token_ids for i in range(len(prompts))], eng

    fast, e1 = run()
    slow, e2 = run(attention="sdpa", cuda_graph=False)
    assert e1.attention == "triton" and e1.stats.cuda_graph and not e2.stats.cuda_graph
    same = sum(a == b for x, y in zip(fast, slow) for a, b in zip(x, y)) / sum(len(x) for x in slow)
    assert same > 0.9, same        # bf16: a near-tie may flip late tokens, nothing more

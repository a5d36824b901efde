"""Prompt-lookup (n-gram) drafting, the baseline every evaluation shows: vLLM's proposal rule, lossless greedy
output, and tokens per target step counted over every verify step."""

from __future__ import annotations

import torch

from eyas.evaluate.decoder import lookup_generate, ngram_propose, target_generate


def test_proposal_rule():
    # longest n in [2, 4] first; of that length the earliest occurrence; up to k following tokens
    assert ngram_propose([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], k=3) == [9, 1, 2]
    assert ngram_propose([5, 6, 7, 5, 6], k=2) == [7, 5]
    assert ngram_propose([7, 1, 2, 4, 1, 2], k=5) == [4, 1, 2]         # fewer than k when the context ends
    assert ngram_propose([1, 2, 3, 4], k=3) == []                       # no repeated bigram
    assert ngram_propose([3, 3, 3], k=2) == [3]                          # overlapping occurrence
    assert ngram_propose([1, 2, 1, 2], k=2, min_n=3) == []


def test_lookup_decoding_is_lossless_and_counts_every_step():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=61, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=13, max_position_embeddings=256, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
    ref = target_generate(model, prompt, 40, set()).tokens
    st = lookup_generate(model, prompt, 3, 40, set())
    assert st.tokens == ref
    # every verify step yields 1 + its accepted tokens (the last round may overshoot the limit)
    assert st.rounds == st.target_steps and len(ref) - 1 <= st.rounds + st.accepted < len(ref) + 3
    assert st.accepted > 0                    # a 13-token vocabulary repeats: some proposals are right
    assert st.acceptance_length == (st.rounds + st.accepted) / st.rounds

"""The reference decoder's sampling, end to end: the whole decoder (tree drafting, temperature 1) reproduces the
target's own distribution of the first two new tokens. Slow on a CPU (400 decodes), so it lives with the e2e tests;
the acceptance rule itself is tested in tests/unit/test_decoder.py."""

import pytest
import torch
from tiny import chi2_pvalue, draft_for, sharp_target

from eyas.evaluate.decoder import SpecConfig, speculative_generate

pytestmark = pytest.mark.e2e

LAYERS = [0, 2, 3]


def test_sampled_decoding_matches_target_sampling_end_to_end():
    """Whole decoder, tree drafting, temperature 1, vocabulary 5: the joint law of the first two new tokens
    (p(x1) * p(x2 | x1), computed exactly from the target) is reproduced."""
    target = sharp_target(seed=2, vocab=5, sharp=2.0)
    draft = draft_for(target, draft_vocab=4)
    prompt = [1, 3]
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].double(), -1)
        joint = torch.stack([p1[a] * torch.softmax(target(torch.tensor([prompt + [a]])).logits[0, -1].double(), -1)
                             for a in range(5)]).flatten()
    counts = torch.zeros(25, dtype=torch.float64)
    spec = SpecConfig(depth=2, topk=2, total_tokens=3, temperature=1.0)
    for s in range(400):
        spec.seed = s
        toks = speculative_generate(target, draft, prompt, LAYERS, spec, 2, set()).tokens
        counts[toks[0] * 5 + toks[1]] += 1
    assert chi2_pvalue(counts, joint) > 1e-3

"""Shared test fixtures: paths to ../shared, a converted stories260K target, tiny random Llama targets."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
STORIES = SHARED / "models" / "stories260K"

# Converted targets are cached per test session, not in the user's cache.
os.environ.setdefault("EYAS_CACHE", str(Path(os.environ.get("TMPDIR", "/tmp")) / "eyas-test-cache"))


@pytest.fixture(scope="session")
def shared() -> Path:
    if not SHARED.exists():
        pytest.skip(f"{SHARED} not found (tests read real data and models from ../shared)")
    return SHARED


@pytest.fixture(scope="session")
def stories_dir(tmp_path_factory, shared) -> Path:
    """stories260K converted to a Hugging Face Llama folder (once per session)."""
    from eyas.targets.llama2c import convert_llama2c

    out = tmp_path_factory.mktemp("stories260K")
    convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", out)
    return out


def tiny_llama(tmp: Path, *, hidden=32, layers=6, heads=4, kv_heads=2, vocab=None, tokenizer_from: Path,
               seed=0) -> Path:
    """A random-weight Llama with an odd small shape, saved with the tokenizer of ``tokenizer_from``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 3 - 1, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab or len(tok),
                      max_position_embeddings=512, tie_word_embeddings=False, head_dim=hidden // heads,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    return tmp

"""Shared test fixtures: paths to ../shared and a converted stories260K target. Tiny random models: tests/tiny.py."""

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

"""extract: target hidden states (aux layers + post-norm last state) into the store, keyed by sample id.

Only samples of this run's tokenized dataset are captured, each validated before commit, in atomically committed
shards; an interrupted run resumes by content, and ``torchrun --nproc-per-node G -m eyas.cli extract CONFIG`` runs
one target replica per rank (:mod:`eyas.store.extraction`). Writes the store folder ``extract/store``
(:mod:`eyas.store.shards`).
"""

from __future__ import annotations

from ..store.extraction import extract_store
from ..summaries import ExtractSummary
from . import RunContext

READS = ("extract", "target")
INPUTS = ("tokenize",)


def reads_target_weights(cfg) -> bool:
    """Both capture backends (transformers, vLLM) load the target's weights from its folder."""
    return True


def run(ctx: RunContext) -> ExtractSummary:
    """Capture every tokenized sample the store lacks; see :func:`eyas.store.extraction.extract_store`."""
    return extract_store(ctx.cfg.target, ctx.cfg.extract, ctx.run, ctx.log)

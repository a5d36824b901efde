"""What a training mix keeps of its sources: decontamination against evaluation sets, near-duplicate removal and
seeded per-source weights and caps. Each function returns what it keeps and why it dropped the rest, so prepare
counts every dropped conversation with its reason.

- Decontamination (:class:`NgramIndex`): a training conversation is contaminated when any of its turns shares a
  word n-gram (13 words by default) with an evaluation prompt, the overlap test of GPT-3's contamination study
  (arXiv 2005.14165, appendix C). Words are lower-cased runs of letters and digits (``\\w+``), so punctuation,
  case and white space do not hide a copy. An evaluation text shorter than n words matches a training turn that is
  the same text word for word (not every turn that contains it: a short prompt is a common phrase).
- Near-duplicates (:class:`NearDuplicateFilter`): MinHash signatures of each conversation's user text (word
  3-gram shingles) in datasketch's LSH index; a conversation whose estimated Jaccard similarity with an earlier
  kept one reaches the threshold is dropped (Broder 1997; Lee et al. 2022, arXiv 2107.06499, deduplicate training
  data this way).
- Weights and caps (:func:`choose`): a seeded random choice (``random.Random`` seeded by the mix seed and the
  source path, so adding a source does not change another's choice), returned in file order.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Sequence

_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    """Lower-cased runs of letters, digits and underscores (``\\w+``, Unicode-aware)."""
    return _WORD.findall(text.lower())


class NgramIndex:
    """Word n-grams of evaluation texts, for finding training texts that copy them.

    ``add(text, label)`` indexes one evaluation text; ``match(texts)`` returns the label of the first evaluation
    text one of ``texts`` overlaps, with the shared words (None when clean). Memory: one tuple per n-gram (about 300K for MT-bench,
    HumanEval and the GSM8K test set at n = 13)."""

    def __init__(self, n: int = 13):
        self.n = n
        self.grams: dict[tuple[str, ...], str] = {}
        self.short: dict[tuple[str, ...], str] = {}  # evaluation texts of fewer than n words: equal turns match
        self.texts = 0
        self.labels: dict[str, int] = {}  # label -> rows indexed under it (filled by the caller)

    def add(self, text: str, label: str) -> None:
        w = words(text)
        if not w:
            return
        self.texts += 1
        if len(w) < self.n:
            self.short.setdefault(tuple(w), label)
            return
        for i in range(len(w) - self.n + 1):
            self.grams.setdefault(tuple(w[i: i + self.n]), label)

    def match(self, texts: Iterable[str]) -> tuple[str, str] | None:
        """``(label, shared words)`` of the first overlap of any of ``texts`` with an indexed text; None if none."""
        for text in texts:
            w = words(text)
            hit = self.short.get(tuple(w)) if len(w) < self.n else None
            if hit is not None:
                return hit, " ".join(w)
            for i in range(len(w) - self.n + 1):
                gram = tuple(w[i: i + self.n])
                hit = self.grams.get(gram)
                if hit is not None:
                    return hit, " ".join(gram)
        return None


def shingles(text: str, k: int = 3) -> set[bytes]:
    """Word k-gram shingles of ``text`` (a text of fewer than k words is one shingle), UTF-8 encoded."""
    w = words(text)
    if len(w) < k:
        return {" ".join(w).encode()} if w else set()
    return {" ".join(w[i: i + k]).encode() for i in range(len(w) - k + 1)}


class NearDuplicateFilter:
    """MinHash LSH over word 3-gram shingles (datasketch). ``seen(key, text)`` returns the key of an earlier kept
    text whose estimated Jaccard similarity with ``text`` is at least ``threshold``, else indexes ``text`` under
    ``key`` and returns None. Deterministic: datasketch's permutations are seeded (``seed=1``).

    Raises ``ImportError`` naming the package when datasketch is not installed."""

    def __init__(self, threshold: float = 0.8, num_perm: int = 128):
        try:
            from datasketch import MinHash, MinHashLSH
        except ImportError:
            raise ImportError("prepare.near_duplicates needs datasketch (pip install 'eyas[data]')") from None
        self._minhash = MinHash
        self.lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
        self.threshold, self.num_perm = threshold, num_perm
        self._template = MinHash(num_perm=num_perm, seed=1)  # permutations made once, copied per text

    def seen(self, key: str, text: str) -> str | None:
        sh = shingles(text)
        if not sh:
            return None
        m = self._template.copy()
        m.update_batch(list(sh))
        for other in self.lsh.query(m):
            return other
        self.lsh.insert(key, m)
        return None


def choose(n_items: int, *, seed: int, salt: str, weight: float | None = None, max_items: int | None = None,
           sizes: Sequence[int] | None = None, max_size: int | None = None) -> tuple[list[int], dict[str, int]]:
    """Indices (ascending) of the items a source keeps, and how many each rule dropped.

    ``weight`` keeps ``round(weight * n)`` items; then ``max_items`` caps the count; then ``max_size`` keeps items
    in the same random order while the sum of their ``sizes`` (tokens) stays within it (an item that would exceed
    the budget is skipped, later smaller ones can still fit). Every choice comes from one permutation seeded by
    ``(seed, salt)``, so the kept items are a prefix-like subset of one random order: a larger cap keeps a
    superset. Raises ``ValueError`` when ``max_size`` is given without ``sizes``."""
    order = list(range(n_items))
    random.Random(f"{seed}:{salt}").shuffle(order)
    dropped: dict[str, int] = {}
    if weight is not None and weight < 1.0:
        keep = round(weight * n_items)
        dropped["weight"] = n_items - keep
        order = order[:keep]
    if max_items is not None and len(order) > max_items:
        dropped["max_conversations"] = len(order) - max_items
        order = order[:max_items]
    if max_size is not None:
        if sizes is None:
            raise ValueError("max_size needs sizes")
        total, kept = 0, []
        for i in order:
            if total + sizes[i] <= max_size:
                kept.append(i)
                total += sizes[i]
        if len(kept) < len(order):
            dropped["max_tokens"] = len(order) - len(kept)
        order = kept
    return sorted(order), dropped


def language_filter(texts: Sequence[str], languages: set[str], *, seed: int = 0) -> list[bool]:
    """Whether each text's detected language (langdetect, seeded so that it is deterministic; ISO 639-1 codes such
    as ``en``) is one of ``languages``; a text with no detectable language (digits only, symbols) is not kept.

    Raises ``ImportError`` naming the package when langdetect is not installed."""
    try:
        from langdetect import DetectorFactory, detect
        from langdetect.lang_detect_exception import LangDetectException
    except ImportError:
        raise ImportError("prepare.self_prompts.languages needs langdetect (pip install 'eyas[data]')") from None
    DetectorFactory.seed = seed
    out = []
    for t in texts:
        try:
            out.append(detect(t) in languages)
        except LangDetectException:
            out.append(False)
    return out

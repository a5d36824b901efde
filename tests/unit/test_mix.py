"""The mix's library: n-gram decontamination, MinHash near-duplicates, seeded weights and caps, language filter."""

import json

import pytest

from eyas.data.mix import NearDuplicateFilter, NgramIndex, choose, language_filter, shingles, words


def test_ngram_index_finds_copies_whatever_the_case_and_punctuation():
    idx = NgramIndex(5)
    idx.add("Write a persuasive email to convince your introverted friend to volunteer.", "mt_bench")
    idx.add("Hi there", "short")
    assert idx.match(["please WRITE a persuasive, email to convince him"]) == (
        "mt_bench", "write a persuasive email to")
    assert idx.match(["write a persuasive letter to convince"]) is None       # no 5 words in a row shared
    assert idx.match(["hi, there!"]) == ("short", "hi there")                 # a short text: the same words
    assert idx.match(["hi there, how are you"]) is None                       # ... not any text containing them
    assert idx.match(["", "nothing", "to convince your introverted friend"]) == (
        "mt_bench", "to convince your introverted friend")


def test_ngram_index_on_a_real_mt_bench_prompt_rewritten(shared):
    row = json.loads((shared / "data" / "eval" / "mt_bench.jsonl").open().readline())
    idx = NgramIndex(13)
    for t in row["turns"]:
        idx.add(t, "mt_bench")
    copied = "Could you help? " + row["turns"][0].upper().replace(",", " ;") + " Thanks."
    assert idx.match([copied])[0] == "mt_bench"
    assert idx.match(["An unrelated question about the weather in Paris in spring and autumn of this year"]) is None


def test_near_duplicates_drop_reworded_copies_not_different_prompts():
    f = NearDuplicateFilter(threshold=0.8)
    base = ("Write a Python function that takes a list of integers and returns the sum of the even numbers in "
            "the list, ignoring negative values and zeros.")
    assert f.seen("a", base) is None
    assert f.seen("b", base.replace("Write", "Please write").replace("zeros.", "zeros!")) == "a"
    assert f.seen("c", "Explain how photosynthesis works in plants, step by step, for a ten year old.") is None
    assert f.seen("d", "Explain how photosynthesis works in plants, step by step, for a ten year old!!") == "c"
    assert f.seen("e", "") is None                                            # nothing to compare: kept
    assert shingles("one two") == {b"one two"} and len(shingles("a b c d")) == 2


def test_near_duplicates_are_deterministic(shared):
    rows = json.loads((shared / "data" / "train" / "evol_code_r2.json").read_text())[:300]
    rows += json.loads((shared / "data" / "train" / "evol_code_r1.json").read_text())[:300]

    def dropped():
        f = NearDuplicateFilter(0.8)
        return [i for i, r in enumerate(rows) if f.seen(str(i), r["instruction"]) is not None]

    a = dropped()
    assert a == dropped() and len(a) > 0                # r2 evolves r1's rows: some are near-copies


def test_choose_is_seeded_nested_and_counts_each_rule():
    kept, dropped = choose(100, seed=0, salt="x.jsonl", max_items=30)
    assert len(kept) == 30 and kept == sorted(kept) and dropped == {"max_conversations": 70}
    assert choose(100, seed=0, salt="x.jsonl", max_items=30)[0] == kept       # same seed, same choice
    assert choose(100, seed=1, salt="x.jsonl", max_items=30)[0] != kept
    assert set(choose(100, seed=0, salt="x.jsonl", max_items=10)[0]) < set(kept)   # a smaller cap: a subset
    kept, dropped = choose(10, seed=0, salt="y", weight=0.5)
    assert len(kept) == 5 and dropped == {"weight": 5}
    sizes = [10] * 10
    kept, dropped = choose(10, seed=0, salt="y", sizes=sizes, max_size=35)
    assert len(kept) == 3 and sum(sizes[i] for i in kept) <= 35 and dropped == {"max_tokens": 7}
    assert choose(5, seed=0, salt="y") == ([0, 1, 2, 3, 4], {})
    with pytest.raises(ValueError):
        choose(5, seed=0, salt="y", max_size=3)


def test_language_filter_keeps_the_named_languages():
    texts = ["How do I sort a list of dictionaries by a key in Python?",
             "Wie kann ich eine Liste von Wörterbüchern nach einem Schlüssel sortieren?",
             "12345 678"]
    assert language_filter(texts, {"en"}) == [True, False, False]
    assert language_filter(texts, {"en", "de"}) == [True, True, False]


def test_words_are_unicode_aware():
    assert words("Café, naïve — 東京!") == ["café", "naïve", "東京"]

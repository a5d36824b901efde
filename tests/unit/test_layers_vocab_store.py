"""Layer-id conventions, the draft vocabulary maps and the hidden-state store."""

from collections import Counter

import pytest
import torch

from eyas.errors import ConfigError, StoreError
from eyas.families import convert_layer_ids, default_aux_layer_ids
from eyas.data.vocab import build_draft_vocab, draft_to_target_ids, maps_from_ids
from eyas.store import HiddenStateStore, StoreHeader


@pytest.mark.parametrize("n, sglang, vllm", [(30, [1, 14, 26], [2, 15, 27]), (32, [1, 15, 28], [2, 16, 29]),
                                             (61, [1, 29, 57], [2, 30, 58])])
def test_default_layer_ids_both_conventions(n, sglang, vllm):
    ids = default_aux_layer_ids(n)
    assert ids == sglang
    assert convert_layer_ids(ids, "output_of_layer", "hf_index") == vllm
    assert convert_layer_ids(vllm, "hf_index", "output_of_layer") == sglang


def test_too_few_layers_needs_explicit_ids():
    with pytest.raises(ConfigError, match="extract.layer_ids"):
        default_aux_layer_ids(5)


def test_draft_vocab_maps():
    counts = Counter({7: 10, 3: 5, 11: 5, 2: 1})
    ids = build_draft_vocab(counts, Counter({5: 9}), target_vocab=16, size=5)
    assert ids.tolist() == [2, 3, 5, 7, 11]  # 4 assistant tokens, then the most frequent other one; ascending
    d2t, t2d = maps_from_ids(ids, 16)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert (torch.arange(5) + d2t).tolist() == ids.tolist()
    assert t2d.nonzero().flatten().tolist() == ids.tolist()
    back = draft_to_target_ids(d2t)                 # the engines' map from a drafted id to the target's
    assert back.dtype == torch.int64 and back.tolist() == ids.tolist()


def _header(run_id="r1", dtype="bfloat16"):
    return StoreHeader(run_id=run_id, target={"path": "t", "config_sha256": "x", "num_layers": 6, "hidden_size": 8},
                       tokenizer={"name_or_path": "t", "vocab_size": 99, "chat_template_sha256": "y"},
                       layer_ids=[1, 2, 3], layer_convention="output_of_layer", last_hidden="post_norm",
                       hidden_size=8, dtype=dtype, engine={"name": "test"})


def _fill(store, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = store.shard_writer()
    data = {}
    for i in range(n):
        T = 3 + i
        ids = torch.randint(0, 99, (T,), generator=g)
        aux = torch.randn(T, 3, 8, generator=g).bfloat16()
        last = torch.randn(T, 8, generator=g).bfloat16()
        w.add(f"s{i}", ids, aux, last)
        data[f"s{i}"] = (ids, aux, last)
        if i == 2:
            w.commit()
    w.close()
    return data


def test_store_roundtrip_random_access(tmp_path):
    store = HiddenStateStore.create_or_open(tmp_path / "st", _header())
    data = _fill(store)
    again = HiddenStateStore.open(tmp_path / "st")
    assert sorted(again.ids()) == sorted(data)
    for sid, (ids, aux, last) in data.items():
        s = again.read(sid)
        assert torch.equal(s.input_ids.long(), ids) and torch.equal(s.aux, aux) and torch.equal(s.last, last)
    assert again.validate_for_resume()["shards"] == 2


def test_store_refuses_other_run_and_bad_samples(tmp_path):
    HiddenStateStore.create_or_open(tmp_path / "st", _header())
    with pytest.raises(StoreError, match="run_id"):
        HiddenStateStore.create_or_open(tmp_path / "st", _header(run_id="other"))
    store = HiddenStateStore.open(tmp_path / "st")
    w = store.shard_writer()
    with pytest.raises(StoreError, match="expected"):
        w.add("x", torch.zeros(4, dtype=torch.long), torch.zeros(4, 2, 8).bfloat16(), torch.zeros(4, 8).bfloat16())
    bad = torch.zeros(4, 3, 8)
    bad[0, 0, 0] = float("nan")
    with pytest.raises(StoreError, match="non-finite"):
        w.add("y", torch.zeros(4, dtype=torch.long), bad.bfloat16(), torch.zeros(4, 8).bfloat16())


def test_truncated_shard_and_orphans_detected_on_resume(tmp_path):
    store = HiddenStateStore.create_or_open(tmp_path / "st", _header())
    _fill(store)
    shard = sorted((tmp_path / "st" / "shards").iterdir())[0]
    orphan = shard.parent / "shard-R000-000099.safetensors"
    orphan.write_bytes(b"partial")
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])
    reopened = HiddenStateStore.open(tmp_path / "st")
    with pytest.raises(StoreError, match="truncated"):
        reopened.validate_for_resume()
    assert not orphan.exists()

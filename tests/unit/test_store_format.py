"""The store's formats and cheap resume checks: fp8 aux states, manifest tails, header hashes, foreign lines."""

import json

import pytest
import torch

from eyas.errors import StoreError
from eyas.store import HiddenStateStore, StoreHeader
from eyas.store.fp8 import FP8_MAX, dequantize_fp8, fp8_has_nan, quantize_fp8

L, H = 3, 40  # odd small width


def _header(run_id="r1", aux_format="same"):
    return StoreHeader(run_id=run_id, target={"path": "t", "config_sha256": "x", "num_layers": 7, "hidden_size": H},
                       tokenizer={"name_or_path": "t", "vocab_size": 99, "chat_template_sha256": "y"},
                       layer_ids=[1, 2, 3], layer_convention="output_of_layer", last_hidden="post_norm",
                       hidden_size=H, dtype="bfloat16", engine={"name": "test"}, aux_format=aux_format)


def _sample(g, T):
    ids = torch.randint(0, 99, (T,), generator=g)
    aux = (torch.randn(T, L, H, generator=g) * torch.logspace(-2, 2, L).view(1, L, 1)).bfloat16()
    return ids, aux, torch.randn(T, H, generator=g).bfloat16()


def _fill(store, lengths, seed=0, commit_every=2):
    g = torch.Generator().manual_seed(seed)
    w = store.shard_writer()
    data = {}
    for i, T in enumerate(lengths):
        data[f"s{i}"] = _sample(g, T)
        w.add(f"s{i}", *data[f"s{i}"])
        if i % commit_every == commit_every - 1:
            w.commit()
    w.close()
    return data


def test_fp8_error_is_within_e4m3_rounding():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(17, L, H, generator=g) * torch.tensor([1e-3, 1.0, 300.0]).view(1, L, 1)
    x[0, 0] = 0.0  # an all-zero row must stay zero, not divide by zero
    q, scale = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (17, L) and scale.dtype == torch.float32
    back = dequantize_fp8(q, scale, torch.float32)
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normal values; subnormal step is 2^-9 of the scale unit
    bound = x.abs() / 16 + scale.unsqueeze(-1) * 2.0**-9 + 1e-30
    assert ((back - x).abs() <= bound).all()
    assert torch.equal(back[0, 0], torch.zeros(H))
    assert (q.float().abs().amax(-1)[1:] == FP8_MAX).all()  # each row uses the full range
    assert not fp8_has_nan(q)
    assert fp8_has_nan(torch.full((2,), float("nan")).to(torch.float8_e4m3fn))


def test_fp8_store_reads_back_dequantised_and_is_smaller(tmp_path):
    lengths = [5, 9, 2, 7]
    plain = HiddenStateStore.create_or_open(tmp_path / "bf16", _header())
    _fill(plain, lengths)
    fp8 = HiddenStateStore.create_or_open(tmp_path / "fp8", _header(aux_format="float8_e4m3fn"))
    data = _fill(fp8, lengths)
    again = HiddenStateStore.open(tmp_path / "fp8")
    for sid, (ids, aux, last) in data.items():
        s = again.read(sid)
        q, sc = quantize_fp8(aux)
        assert s.aux.dtype == torch.bfloat16 and s.aux.shape == aux.shape
        assert torch.equal(s.aux, dequantize_fp8(q, sc, torch.bfloat16))
        assert torch.equal(s.last, last) and torch.equal(s.input_ids.long(), ids)
        stored = again.read_stored(sid)
        assert stored["aux"].dtype == torch.float8_e4m3fn and stored["aux_scale"].shape == (len(ids), L)
    tokens = sum(lengths)
    b_plain = sum(r.bytes for r in plain.manifest_records()) / tokens
    b_fp8 = sum(r.bytes for r in again.manifest_records()) / tokens
    # per token: bf16 stores 8H + 4 bytes, fp8 3H + 12 (scales) + 2H + 4, plus the safetensors headers
    assert 8 * H + 4 < b_plain < 8 * H + 4 + 120
    assert 5 * H + 16 < b_fp8 < 5 * H + 16 + 160
    assert again.validate_for_resume()["samples"] == len(lengths)


def test_torn_manifest_tail_and_orphan_are_cleaned_on_resume(tmp_path):
    store = HiddenStateStore.create_or_open(tmp_path / "st", _header())
    _fill(store, [3, 4, 5, 6])  # two shards
    mf = tmp_path / "st" / "manifest" / "rank-000.jsonl"
    lines = mf.read_text().splitlines(keepends=True)
    mf.write_text(lines[0] + lines[1][: len(lines[1]) // 2])  # crash while appending the second line
    reopened = HiddenStateStore.open(tmp_path / "st")
    assert sorted(reopened.ids()) == ["s0", "s1"]  # the torn line is not trusted
    counts = reopened.validate_for_resume()
    assert counts == {"shards": 1, "samples": 2, "orphans_removed": 1}  # its shard was an orphan
    assert mf.read_text() == lines[0]
    w = reopened.shard_writer()
    assert w.next_index == 1  # the orphan's name is free again: nothing lists it
    w.close()


def test_resume_detects_changed_header_and_foreign_line(tmp_path):
    store = HiddenStateStore.create_or_open(tmp_path / "st", _header())
    _fill(store, [3, 4], commit_every=2)
    shard = next((tmp_path / "st" / "shards").iterdir())
    data = bytearray(shard.read_bytes())
    i = data.index(b"s1.last")
    data[i: i + 2] = b"s9"  # same size, a renamed tensor
    shard.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="header differs"):
        HiddenStateStore.open(tmp_path / "st").validate_for_resume()

    other = HiddenStateStore.create_or_open(tmp_path / "other", _header(run_id="r2"))
    _fill(other, [3], seed=5)
    mf = tmp_path / "st" / "manifest" / "rank-000.jsonl"
    rec = json.loads((tmp_path / "other" / "manifest" / "rank-000.jsonl").read_text())
    mf.write_text(json.dumps(rec) + "\n")
    for p in (tmp_path / "other" / "shards").iterdir():
        p.rename(shard.parent / p.name)
    with pytest.raises(StoreError, match="foreign"):
        HiddenStateStore.open(tmp_path / "st").validate_for_resume()


def test_writer_refuses_duplicates_and_unscaled_fp8(tmp_path):
    store = HiddenStateStore.create_or_open(tmp_path / "st", _header(aux_format="float8_e4m3fn"))
    g = torch.Generator().manual_seed(0)
    ids, aux, last = _sample(g, 4)
    w = store.shard_writer()
    w.add("a", ids, aux, last)
    with pytest.raises(StoreError, match="already"):
        w.add("a", ids, aux, last)
    with pytest.raises(StoreError, match="aux_scale"):
        w.add("b", ids, aux.to(torch.float8_e4m3fn), last)
    w.close()
    with pytest.raises(StoreError, match="already"):
        store.shard_writer().add("a", ids, aux, last)


def test_background_writer_commits_valid_samples_and_raises_the_bad_ones(tmp_path):
    from eyas.capture import CapturedSample
    from eyas.store.pipeline import BackgroundWriter

    store = HiddenStateStore.create_or_open(tmp_path / "st", _header())
    g = torch.Generator().manual_seed(2)
    bg = BackgroundWriter(store.shard_writer(), shard_bytes=3000, workers=2)
    data = {}
    for i in range(6):
        data[f"s{i}"] = _sample(g, 3 + i)
        bg.put(CapturedSample(f"s{i}", *data[f"s{i}"]))
    ids, aux, last = _sample(g, 4)
    aux[1, 2, 3] = float("inf")
    bg.put(CapturedSample("bad", ids, aux, last, finite=False))
    with pytest.raises(StoreError, match="sample bad: non-finite"):
        bg.close()
    again = HiddenStateStore.open(tmp_path / "st")
    assert sorted(again.ids()) == sorted(data) and len(again.manifest_records()) > 1
    for sid, (ids, aux, last) in data.items():
        assert torch.equal(again.read(sid).aux, aux)
    assert bg.samples == 6 and bg.tokens == sum(3 + i for i in range(6))


def test_streamed_shard_is_a_valid_safetensors_file(tmp_path):
    from safetensors.torch import load_file

    store = HiddenStateStore.create_or_open(tmp_path / "st", _header(aux_format="float8_e4m3fn"))
    data = _fill(store, [3, 8, 1], commit_every=3)
    shard = next((tmp_path / "st" / "shards").iterdir())
    loaded = load_file(shard)  # the library's own reader validates header, dtypes and offsets
    assert len(loaded) == 4 * len(data)
    for sid, (ids, aux, last) in data.items():
        assert torch.equal(loaded[f"{sid}.input_ids"], ids.to(torch.int32))
        assert torch.equal(loaded[f"{sid}.last"], last)
        assert loaded[f"{sid}.aux"].dtype == torch.float8_e4m3fn
    assert int.from_bytes(shard.read_bytes()[:8], "little") % 8 == 0

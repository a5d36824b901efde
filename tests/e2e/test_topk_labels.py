"""Compact soft labels (``extract.labels: topk``) on the real stories260K target: extract writes them, ``eyas
doctor`` checks and repairs them, ``eyas plan`` sizes them, offline training reads them. The independent reference
is the same run's store of last hidden states (``labels: hidden``), from which training computes the labels through
the target's lm_head: with every draft id kept (k = Dv) the two trainings give the same losses up to the fp16
rounding of the stored probabilities."""

from __future__ import annotations

import json

import pytest
import yaml

from eyas.config import load_config
from eyas.errors import StoreError
from eyas.stages import RunContext, init_run_dir, run_stage
from eyas.store import HiddenStateStore
from eyas.store.doctor import diagnose, repair
from eyas.store.labels import label_bytes_per_token

pytestmark = pytest.mark.e2e
STAGES = ["prepare", "generate", "tokenize", "vocab", "extract", "train"]
DV = 200


def _config(tmp_path, shared, name: str, **extract):
    stories = shared / "models" / "stories260K"
    cfg = {
        "run_dir": str(tmp_path / name),
        "target": {"model": str(stories / "stories260K.bin"), "tokenizer": str(stories / "tok512.bin")},
        "prepare": {"sources": [{"path": str(shared / "data" / "train" / "gsm8k_train.jsonl"), "max_rows": 12}]},
        "generate": {"enabled": False},
        "tokenize": {"max_length": 160},
        "vocab": {"draft_vocab_size": DV},
        "extract": {"layer_ids": [1, 2, 3], "dtype": "float32", "shard_bytes": 200_000, **extract},
        "train": {"ttt_steps": 3, "epochs": 2, "lr": 3e-3, "batch_size": 3, "checkpoint_every": 100,
                  "eval_samples": 2, "eval_every": 3},
    }
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def _run(path, stages, logs=None):
    ctx = RunContext(cfg=load_config(path), log=(logs.append if logs is not None else lambda m: None))
    init_run_dir(ctx, ["test"])
    return {s: run_stage(ctx, s) for s in stages}


def _rows(run_dir):
    return [json.loads(x) for x in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]


def test_topk_labels_written_read_checked_and_sized(tmp_path, shared):
    ref = _run(_config(tmp_path, shared, "hidden"), STAGES)
    logs: list[str] = []
    full = _run(_config(tmp_path, shared, "full", labels="topk", label_topk=DV), STAGES, logs)

    # training on every draft id's stored probability is training on the last hidden state's labels
    a, b = _rows(tmp_path / "hidden"), _rows(tmp_path / "full")
    assert len(a) == len(b) == ref["train"].steps > 2
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=2e-3)
        assert [rb[f"count_{k}"] for k in range(3)] == [ra[f"count_{k}"] for k in range(3)]
    assert b[-1]["eval_loss"] == pytest.approx(a[-1]["eval_loss"], rel=2e-3)

    # the store holds labels, not the last state, at the bytes the formula gives; the summary has the mass curve
    store = HiddenStateStore.open(tmp_path / "full" / "extract" / "store")
    h = store.header
    assert h.topk and h.label_topk == DV and h.draft_vocab_size == DV and len(h.draft_vocab_sha256) == 64
    st = store.read(store.ids()[0], verify=True)
    assert st.last is None and st.labels.ids.dtype.itemsize == 2 and st.labels.probs.shape[1] == DV
    ex = full["extract"]
    assert ex.labels == "topk" and ex.label_topk == DV and ex.label_mass_by_k[DV] >= 0.999
    per_tok_ref = ref["extract"].store_bytes / ref["extract"].tokens
    per_tok = ex.store_bytes / ex.tokens
    H = h.hidden_size
    assert per_tok - per_tok_ref == pytest.approx(label_bytes_per_token(DV, DV) - 4 * H, abs=2.0)  # fp32 last
    assert any("draft ids hold" in m for m in logs)

    # a small k with fp8 aux states: what a large target would store; it still trains
    logs.clear()
    k8 = _run(_config(tmp_path, shared, "k8", labels="topk", label_topk=8, label_mass=0.999,
                      aux_format="float8_e4m3fn"), STAGES, logs)
    assert k8["train"].loss < k8["train"].first_loss
    curve = k8["extract"].label_mass_by_k
    assert 0 < curve[1] <= curve[8] <= curve[DV] <= 1.0 + 1e-6
    assert any("extract.label_topk 8 holds less than extract.label_mass 0.999" in m for m in logs)

    # eyas doctor: clean; a flipped byte in one sample's labels is found and repaired (re-extracted, labels again)
    run = tmp_path / "k8"
    assert diagnose(run).clean
    s8 = HiddenStateStore.open(run / "extract" / "store")
    rec = s8.manifest_records()[0]
    sid = rec.samples[0].id
    path = run / "extract" / "store" / "shards" / rec.shard
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    begin, _ = json.loads(raw[8: 8 + n])[f"{sid}.label_probs"]["data_offsets"]
    raw[8 + n + begin + 1] ^= 0x40
    path.write_bytes(bytes(raw))
    report = diagnose(run)
    assert {f.sample for f in report.findings if f.kind == "corrupt"} == {sid}
    before = {e.id: e.checksum for r in s8.manifest_records() for e in r.samples}
    repair(report, log=lambda m: None)
    assert diagnose(run).clean
    after = {e.id: e.checksum for r in HiddenStateStore.open(run / "extract" / "store").manifest_records()
             for e in r.samples}
    assert after == before                      # re-extracted to the same bytes

    # another draft vocabulary: the labels are refused, naming the field and the rebuild
    cfg = _config(tmp_path, shared, "k8", labels="topk", label_topk=8, label_mass=0.999,
                  aux_format="float8_e4m3fn")
    raw_cfg = yaml.safe_load(cfg.read_text())
    raw_cfg["vocab"]["draft_vocab_size"] = 150
    cfg.write_text(yaml.safe_dump(raw_cfg))
    ctx = RunContext(cfg=load_config(cfg), log=lambda m: None, force=True, redo=frozenset({"vocab"}))
    init_run_dir(ctx, ["test"])
    run_stage(ctx, "vocab")
    ctx = RunContext(cfg=load_config(cfg), log=lambda m: None)
    with pytest.raises(StoreError, match=r"draft_vocab_sha256.*eyas extract CONFIG --force"):
        run_stage(ctx, "train")


def test_plan_sizes_topk_labels(tmp_path, shared):
    from eyas.plan import plan

    p = plan(load_config(_config(tmp_path, shared, "plan", labels="topk", label_topk=32,
                                 aux_format="float8_e4m3fn")), sample=4)
    H, L = p.hidden_size, 3
    assert p.bytes_per_token["bfloat16"] == (L + 1) * H * 2
    assert p.bytes_per_token["fp8_topk"] == L * (H + 4) + 32 * 4 + 1
    assert p.store_bytes == pytest.approx((p.bytes_per_token["fp8_topk"] + 4) * p.mean_tokens_per_sample
                                          * p.dataset_samples, rel=1e-3)
    hidden = plan(load_config(_config(tmp_path, shared, "plan2")), sample=4)
    assert any(k.startswith("extract.labels: topk") for k in hidden.cheaper)

"""The training loop's speed settings change how batches are made, never what is trained: DataLoader workers give
the same run as building batches in the loop's process; the padded-length multiple leaves the loss unchanged; the
held-out stop ends a run whose held-out step-0 accuracy stopped rising."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.train.data import collate
from eyas.train.loop import train
from test_train_loop import ToySet, toy_cfg, toy_model  # tests/unit is on sys.path (pytest rootdir mode)


def _rows(path):
    return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]


def _losses(path):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in _rows(path)]


def test_loader_workers_train_exactly_like_the_loop_process(tmp_path):
    data = ToySet(10, seed=1)
    runs = {}
    for workers in (0, 2):
        m, head = toy_model()
        cfg = toy_cfg(epochs=2, loader_workers=workers, batch_tokens=40)
        runs[workers] = train(m, data, head, cfg, tmp_path / str(workers), torch.device("cpu"), {}, log=lambda s: None)
    assert _losses(tmp_path / "0") == _losses(tmp_path / "2")
    for k, v in runs[0].final_state.items():
        assert torch.equal(v, runs[2].final_state[k]), k


def test_padding_to_a_multiple_keeps_the_loss():
    """collate(pad_to=64) only appends masked positions: the TTT loss and counts of the batch are unchanged."""
    from eyas.train.loss import step_counts, target_labels, ttt_loss_fused

    data = ToySet(4, seed=7)
    m, head = toy_model()
    draft_ids = (m.d2t + torch.arange(len(m.d2t))).long()
    out = []
    for pad in (1, 64):
        b = collate([data[i] for i in range(4)], pad)
        assert b["input_ids"].shape[1] == (12 if pad == 1 else 64)
        labels = target_labels(b["last"], head, draft_ids, m.t2d, b["loss_mask"])
        with torch.no_grad():
            loss, metrics = ttt_loss_fused(m(b["input_ids"], b["aux"], 3), m.norm, m.lm_head.weight, labels, 0.8)
        out.append((float(loss), step_counts(labels, 3).tolist()))
    assert out[0][1] == out[1][1]
    assert out[1][0] == pytest.approx(out[0][0], rel=1e-5)


def test_stop_after_no_gain_ends_the_run(tmp_path):
    """With lr 0 the held-out accuracy never rises: the run stops after the first evaluation plus N without gain,
    checkpointed, and says so."""
    data, held = ToySet(12, seed=4), ToySet(3, seed=5)
    m, head = toy_model()
    cfg = toy_cfg(lr=1e-12, epochs=4, batch_size=1, eval_every=2, stop_after_no_gain=2)
    logs = []
    res = train(m, data, head, cfg, tmp_path, torch.device("cpu"), {}, log=logs.append, held_out=held)
    rows = _rows(tmp_path)
    assert res.stopped_early and res.steps == 6 < 48          # evaluations at 2 (best), 4, 6 (no gain twice)
    assert [r["step"] for r in rows if "eval_acc_0" in r] == [2, 4, 6]
    assert (tmp_path / "checkpoints" / "step-00000006").exists()
    assert any("stopping at step 6 of 48" in x for x in logs)


def test_draft_vocabulary_sized_by_coverage():
    from collections import Counter

    from eyas.data.vocab import coverage_curve, size_for_coverage

    counts = Counter({t: 1000 // (t + 1) for t in range(500)})     # Zipf-like
    curve = coverage_curve(counts, [64, 128, 500])
    assert curve[500] == 1.0 and curve[64] < curve[128] < 1.0
    n = size_for_coverage(counts, 0.9, cap=10_000)
    assert n % 64 == 0 and coverage_curve(counts, [n])[n] >= 0.9 and coverage_curve(counts, [n - 64])[n - 64] < 0.9
    assert size_for_coverage(counts, 0.9, cap=64) == 64


def test_epochs_with_different_numbers_of_token_budget_batches(tmp_path):
    """Token-budget buckets depend on each epoch's order, so epochs can hold different numbers of micro-batches;
    the run walks each epoch's own batches (the H200 run of issue 11 stopped with an IndexError in epoch 2 before
    this) and sees every sample once per whole epoch."""
    from eyas.config import TrainConfig
    from eyas.train.loop import Plan

    class Lengths:
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.n = torch.randint(5, 300, (600,), generator=g).tolist()

        def __len__(self):
            return len(self.n)

        def num_tokens(self, i):
            return self.n[i]

    plan = Plan(Lengths(), TrainConfig(epochs=6.5, batch_tokens=1000, device="cpu"), world=1)
    sizes = [plan.size(e) for e in range(7)]
    assert len(set(sizes)) > 1                      # the case that broke: epochs of different lengths
    seen, m = [], 0
    for e in range(6):
        for _ in range(sizes[e]):
            seen += plan.micro(m, 0)
            m += 1
        assert sorted(seen) == sorted(list(range(600)) * (e + 1))
    for m in range(plan.total_micro):
        plan.micro(m, 0)

"""The training loop on a tiny odd-shaped draft: exact resume, NaN stop, TensorBoard, held-out evaluation,
token-budget batches, and two processes (gloo) equal to one process with the same global batch."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
from tiny import draft_config, set_vocab, tiny_draft

from eyas.config import TrainConfig
from eyas.errors import EyasError
from eyas.model.eagle3 import Eagle3DraftModel
from eyas.train.data import collate, epoch_plan
from eyas.train.loop import train
from eyas.train.loss import target_labels, ttt_loss

V, DV, HT = 99, 31, 24


class ToySet:
    """In-memory samples shaped like :class:`eyas.train.data.SampleDataset` items (random states, odd lengths)."""

    def __init__(self, n: int, seed: int, nan_sample: int | None = None):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for i in range(n):
            T = 5 + (i * 7) % 9
            mask = torch.ones(T, dtype=torch.int64)
            mask[: 1 + i % 3] = 0
            aux = torch.randn(T, 3 * HT, generator=g)
            if i == nan_sample:
                aux[2, 5] = float("nan")
            self.items.append({"id": f"toy-{i}", "input_ids": torch.randint(0, V, (T,), generator=g),
                               "loss_mask": mask, "aux": aux, "last": torch.randn(T, HT, generator=g)})

    def __len__(self):
        return len(self.items)

    def num_tokens(self, i):
        return len(self.items[i]["input_ids"])

    def __getitem__(self, i):
        return self.items[i]


def toy_model(seed: int = 0) -> tuple[Eagle3DraftModel, torch.Tensor]:
    m = tiny_draft(draft_config(hidden=HT, intermediate=37, heads=4, kv_heads=2, head_dim=6, vocab=V, draft_vocab=DV),
                   seed=seed)
    set_vocab(m, torch.randperm(V)[:DV].sort().values)
    target = torch.Generator().manual_seed(12345)          # the "target's" tables do not depend on the seed
    with torch.no_grad():
        m.embed_tokens.weight.copy_(torch.randn(V, HT, generator=target))
    return m, torch.randn(V, HT, generator=target) * 2


def toy_cfg(**kw) -> TrainConfig:
    base = dict(ttt_steps=3, epochs=1, lr=3e-3, batch_size=2, checkpoint_every=100, keep_last=2, seed=3,
                device="cpu", tensorboard=False, warmup_ratio=0.2)
    base.update(kw)
    return TrainConfig(**base)


def _losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


def test_resume_continues_exactly(tmp_path):
    cfg = toy_cfg(checkpoint_every=1, keep_last=2, epochs=2)
    data = ToySet(6, seed=1)
    m, head = toy_model()
    full = train(m, data, head, cfg, tmp_path / "a", torch.device("cpu"), {"fp": 1}, log=lambda s: None)
    m, head = toy_model()
    part = train(m, data, head, cfg, tmp_path / "b", torch.device("cpu"), {"fp": 1}, log=lambda s: None,
                 should_stop=lambda step: step == 4)
    assert part.steps == 4 and len(list((tmp_path / "b" / "checkpoints").glob("step-*"))) == 2   # keep_last
    m, _ = toy_model(seed=99)            # a different init and vocabulary: all must come from the checkpoint
    rest = train(m, data, head, cfg, tmp_path / "b", torch.device("cpu"), {"fp": 1}, log=lambda s: None)
    assert rest.steps == full.steps == 6
    assert _losses(tmp_path / "b") == _losses(tmp_path / "a")           # step for step, bit for bit on CPU
    for k, v in full.final_state.items():
        assert torch.equal(v, rest.final_state[k]), k
    with pytest.raises(EyasError, match="another configuration"):
        train(m, data, head, cfg.model_copy(update={"epochs": 3}), tmp_path / "b", torch.device("cpu"),
              {"fp": 2}, log=lambda s: None)


def test_nan_stops_naming_step_and_samples(tmp_path):
    data = ToySet(8, seed=2, nan_sample=5)
    m, head = toy_model()
    cfg = toy_cfg(batch_size=2)
    order = epoch_plan([data.num_tokens(i) for i in range(8)], 2, 1, cfg.seed, 0)
    bad_step = next(i for i, b in enumerate(order) if 5 in b[0]) + 1
    with pytest.raises(EyasError, match=rf"at step {bad_step};.*toy-5"):
        train(m, data, head, cfg, tmp_path, torch.device("cpu"), {}, log=lambda s: None)


def test_tensorboard_and_held_out_eval(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data, held = ToySet(8, seed=4), ToySet(3, seed=5)
    m, head = toy_model()
    cfg = toy_cfg(tensorboard=True, eval_every=2)
    res = train(m, data, head, cfg, tmp_path, torch.device("cpu"), {}, log=lambda s: None, held_out=held)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4]
    ea = EventAccumulator(str(tmp_path / "tensorboard"))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "ttt/acc_0", "ttt/acc_2",
            "eval/eval_loss"} <= tags
    assert [e.value for e in ea.Scalars("train/loss")] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    # the last evaluation equals the loss of the final draft on all held-out samples as one batch
    m.load_state_dict(res.final_state, strict=False)
    b = collate([held[i] for i in range(len(held))])
    draft_ids = (m.d2t + torch.arange(DV)).long()
    labels = target_labels(b["last"], head, draft_ids, m.t2d, b["loss_mask"])
    with torch.no_grad():
        hs = m(b["input_ids"], b["aux"], 3)
        ref, metrics = ttt_loss([m.logits(h) for h in hs], labels, 0.8)
    assert rows[-1]["eval_loss"] == pytest.approx(ref.item(), rel=1e-5)
    assert rows[-1]["eval_acc_1"] == pytest.approx(metrics["acc_1"])


def test_token_budget_plan():
    lengths = [3, 17, 8, 8, 30, 5, 12, 9, 40, 2, 6, 11]
    plan = epoch_plan(lengths, 1, 1, seed=0, epoch=0, batch_tokens=32)
    seen = sorted(i for mb in plan for i in mb[0])
    assert seen == list(range(len(lengths)))
    for mb in plan:
        b = mb[0]
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 32
    assert plan == epoch_plan(lengths, 1, 1, seed=0, epoch=0, batch_tokens=32)       # deterministic
    two = epoch_plan(lengths, 1, 2, seed=0, epoch=0, batch_tokens=32)
    assert all(len(mb) == 2 for mb in two)


# ---------------------------------------------------------------- two processes (gloo) = one process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, world: int, port: int) -> None:
    """This forked child as process ``rank`` of ``world`` (the environment torchrun would set), one thread."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)


def _worker(rank: int, world: int, port: int, strategy: str, out: str):
    _join(rank, world, port)
    data = ToySet(5, seed=6)
    m, head = toy_model()
    cfg = toy_cfg(batch_size=4 // world, distributed=strategy, checkpoint_every=1, eval_every=1)
    res = train(m, data, head, cfg, Path(out), torch.device("cpu"), {}, log=lambda s: None,
                should_stop=lambda step: step == 2, held_out=ToySet(3, seed=7))
    if rank == 0:
        torch.save(res.final_state, Path(out) / "final.pt")
    import torch.distributed as dist

    dist.destroy_process_group()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_equal_one(tmp_path, strategy):
    import torch.multiprocessing as mp

    one = tmp_path / "one"
    two = tmp_path / "two"
    torch.set_num_threads(1)
    # one process, global batch 4
    data = ToySet(5, seed=6)
    m, head = toy_model()
    r1 = train(m, data, head, toy_cfg(batch_size=4, checkpoint_every=1, eval_every=1), one, torch.device("cpu"),
               {}, log=lambda s: None, should_stop=lambda step: step == 2, held_out=ToySet(3, seed=7))
    # two processes, 2 each; 5 samples: the second global micro-batch has 1 (process 1 gets a weightless stand-in)
    mp.start_processes(_worker, args=(2, _free_port(), strategy, str(two)), nprocs=2, join=True,
                       start_method="fork")      # fork: the children skip re-importing torch (seconds on CI)
    l1, l2 = _losses(one), _losses(two)
    assert [s for s, _ in l1] == [s for s, _ in l2] == [1, 2]
    assert [x for _, x in l2] == pytest.approx([x for _, x in l1], rel=1e-6)
    e1, e2 = ([json.loads(x)["eval_loss"] for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (one, two))
    assert e2 == pytest.approx(e1, rel=1e-5)      # 3 held-out samples over 2 processes: uneven rounds
    # after two optimizer steps, equal weights mean equal gradients at both steps (AdamW is elementwise)
    final2 = torch.load(two / "final.pt", weights_only=True)
    assert set(final2) == set(r1.final_state)
    for k, v in r1.final_state.items():
        torch.testing.assert_close(final2[k], v, rtol=1e-5, atol=1e-6)
    # and the checkpoint written by the two processes resumes in one process
    s1 = json.loads((one / "checkpoints" / "step-00000002" / "state.json").read_text())
    s2 = json.loads((two / "checkpoints" / "step-00000002" / "state.json").read_text())
    assert s1["micro"] == s2["micro"] == 2 and s2["world"] == 2


def _worker_stop(rank: int, world: int, port: int, out: str):
    _join(rank, world, port)
    m, head = toy_model()
    cfg = toy_cfg(batch_size=2, epochs=3, distributed="fsdp", checkpoint_every=100)
    # only process 0 sees the request, as when RUN/train/STOP appears between the processes' checks
    res = train(m, ToySet(5, seed=6), head, cfg, Path(out), torch.device("cpu"), {}, log=lambda s: None,
                should_stop=lambda step: rank == 0 and step == 2)
    Path(out, f"steps.{rank}").write_text(str(res.steps))
    import torch.distributed as dist

    dist.destroy_process_group()


def test_a_stop_seen_by_one_process_stops_every_process_after_the_same_step(tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_worker_stop, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=False,
                             start_method="fork")
    try:   # before the stop was shared, process 1 went on to step 3 alone and the two hung in their collectives
        for _ in range(240):
            if ctx.join(timeout=0.5):
                break
        else:
            pytest.fail("the two processes did not end within 120 s (one stopped, the other went on)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    assert [(tmp_path / f"steps.{r}").read_text() for r in (0, 1)] == ["2", "2"]
    assert [s for s, _ in _losses(tmp_path)] == [1, 2]
    assert (tmp_path / "checkpoints" / "step-00000002").exists()


def test_token_budget_and_accumulation_cover_every_token(tmp_path):
    data = ToySet(9, seed=8)
    m, head = toy_model()
    cfg = toy_cfg(batch_tokens=24, grad_accum=2, epochs=2)
    res = train(m, data, head, cfg, tmp_path, torch.device("cpu"), {}, log=lambda s: None)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    n_micro = sum(len(epoch_plan([data.num_tokens(i) for i in range(9)], 2, 1, cfg.seed, e, 24)) for e in (0, 1))
    assert res.steps == len(rows) == -(-n_micro // 2)
    assert rows[-1]["tokens"] == 2 * sum(data.num_tokens(i) for i in range(9))   # real tokens, no padding


def test_wandb_asked_for_but_missing_warns(tmp_path):
    pytest.importorskip("tensorboard")
    try:
        import wandb  # noqa: F401
        pytest.skip("wandb is installed here")
    except ImportError:
        pass
    m, head = toy_model()
    with pytest.warns(UserWarning, match="wandb is not installed"):
        train(m, ToySet(2, seed=9), head, toy_cfg(wandb_project="eyas-test"), tmp_path, torch.device("cpu"), {},
              log=lambda s: None)


# ---------------------------------------------------------------- train.autocast, train.compile


def test_autocast_bfloat16_runs_the_draft_in_bf16_and_keeps_the_loss(tmp_path):
    data = ToySet(6, seed=10)
    runs = {}
    for mode in ("none", "bfloat16"):
        m, head = toy_model()
        seen: set = set()
        m.fc.register_forward_hook(lambda mod, inp, out: seen.add(out.dtype))
        train(m, data, head, toy_cfg(autocast=mode, epochs=2), tmp_path / mode, torch.device("cpu"), {},
              log=lambda s: None)
        runs[mode] = (_losses(tmp_path / mode), seen)
    (fp32, seen32), (bf16, seen16) = runs["none"], runs["bfloat16"]
    assert seen32 == {torch.float32} and seen16 == {torch.bfloat16}   # autocast reached the draft's matmuls
    assert [s for s, _ in bf16] == [s for s, _ in fp32] and bf16 != fp32
    assert [x for _, x in bf16] == pytest.approx([x for _, x in fp32], rel=0.05)   # same run, bf16 rounding


def test_compile_compiles_the_step_parts_and_the_loss_and_keeps_the_numbers(tmp_path, monkeypatch):
    """train.compile wraps the TTT step's parts and the loss chunks in torch.compile; traced by dynamo (backend
    'eager' here: no C++ toolchain needed), the run gives the uncompiled run's losses."""
    from eyas.train import loss as loss_module

    real_compile, compiled = torch.compile, []

    def tracing_compile(fn, **kw):
        compiled.append(fn.__name__)
        return real_compile(fn, **{**kw, "backend": "eager"})

    monkeypatch.setattr(torch, "compile", tracing_compile)
    loss_module._soft_ce_kernel.cache_clear()
    try:
        data = ToySet(5, seed=11)
        for on in (False, True):
            m, head = toy_model()
            train(m, data, head, toy_cfg(compile=on), tmp_path / str(on), torch.device("cpu"), {},
                  log=lambda s: None)
    finally:
        loss_module._soft_ce_kernel.cache_clear()
        torch._dynamo.reset()
    assert sorted(compiled) == ["_soft_ce_chunk", "ttt_in", "ttt_out"]
    eager, comp = _losses(tmp_path / "False"), _losses(tmp_path / "True")
    assert [s for s, _ in comp] == [s for s, _ in eager]
    assert [x for _, x in comp] == pytest.approx([x for _, x in eager], rel=1e-5)

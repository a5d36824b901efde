"""train.fp8 (issue 20 item 2): the setting, its fallback on a CPU (the same run as fp8 off, bit for bit, and said
so), a missing torchao or an older GPU, and, where torchao is installed, the conversion itself: which layers, the
same state_dict keys, the converted layers really used in the TTT forward under autocast, and a run through the loop
(torchao's emulation: fp8 rounding with high-precision products, which needs no GPU) that checkpoints plain weights
under the usual names and resumes."""

from __future__ import annotations

import functools
import json
import sys

import pytest
import torch
from safetensors.torch import load_file
from test_train_loop import ToySet, _losses, toy_cfg, toy_model  # tests/unit is on sys.path (pytest rootdir mode)
from tiny import draft_config, set_vocab, stories_train_run, tiny_draft

from eyas.config import TrainConfig, load_config
from eyas.errors import ConfigError
from eyas.summaries import TrainSummary
from eyas.train import fp8 as fp8_module
from eyas.train import loop as loop_module
from eyas.train.fp8 import Fp8Conversion, apply_fp8_training
from eyas.train.loop import train

CPU = torch.device("cpu")
FALLBACK = ("[eyas] train: train.fp8: tensorwise needs a CUDA GPU of compute capability 8.9 or newer and torchao; "
            "this run is on cpu: training in float32 matrix products instead")
ATTN = [f"midlayer.self_attn.{p}_proj" for p in "qkvo"]
MLP = [f"midlayer.mlp.{p}_proj" for p in ("gate", "up", "down")]


def draft16(intermediate: int = 48, seed: int = 0):
    """A draft whose layers are multiples of 16 (hidden 32, 4 heads of 8, 2 key-value heads: q 64->32, k/v 64->16,
    fc 96->32), except the MLP when ``intermediate`` is not; a 48-row lm_head (a multiple of 16, kept all the same)."""
    return tiny_draft(draft_config(hidden=32, intermediate=intermediate, heads=4, kv_heads=2, head_dim=8,
                                   draft_vocab=48), seed=seed)


# ---------------------------------------------------------------- the setting


def test_config_takes_the_recipes_and_refuses_others_naming_the_field(tmp_path):
    assert TrainConfig().fp8 == "off"
    for v in ("off", "tensorwise", "rowwise"):
        assert load_config("demo", [f"train.fp8={v}"]).train.fp8 == v
    p = tmp_path / "c.yaml"                              # YAML 1.1 reads an unquoted off as false: still "off"
    p.write_text("target: {model: m}\nprepare: {sources: [{path: a.jsonl}]}\ntrain: {fp8: off}\n")
    assert load_config(p).train.fp8 == "off"
    for bad in ("e4m3", "on", "true"):
        with pytest.raises(ConfigError, match=r"train\.fp8: Input should be 'off', 'tensorwise' or 'rowwise'"):
            load_config("demo", [f"train.fp8={bad}"])


def test_summary_reads_done_json_without_the_fields_and_with_them():
    base = {"steps": 3, "trainable_parameters": 10, "mode": "offline", "tokens_per_s": 1.0}
    assert TrainSummary(**base).fp8 == "off"             # a run from before the setting used none
    s = TrainSummary(**base, fp8="off", fp8_fallback="this run is on cpu")
    assert TrainSummary.model_validate(s.to_json()) == s
    assert s.to_json()["fp8_fallback"] == "this run is on cpu"


# ---------------------------------------------------------------- the fallback


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_cpu_run_falls_back_to_the_off_run_bit_for_bit_and_says_so(tmp_path, recipe):
    data = ToySet(6, seed=21)
    runs, logs = {}, []
    for mode in ("off", recipe):
        m, head = toy_model()
        runs[mode] = train(m, data, head, toy_cfg(fp8=mode, epochs=2), tmp_path / mode, CPU, {}, log=logs.append)
    assert _losses(tmp_path / recipe) == _losses(tmp_path / "off")           # step for step, bit for bit
    for k, v in runs["off"].final_state.items():
        assert torch.equal(v, runs[recipe].final_state[k]), k
    assert runs["off"].fp8 == Fp8Conversion("off")
    used = runs[recipe].fp8
    assert used.recipe == "off" and used.layers == () and used.fallback == "this run is on cpu"
    assert logs == [FALLBACK.replace("tensorwise", recipe)]                 # one line, from the fp8 run only


def test_missing_torchao_and_older_gpus_fall_back_without_converting(monkeypatch):
    logs: list[str] = []
    m = draft16()
    before = {n: type(x) for n, x in m.named_modules()}
    out = apply_fp8_training(m, "tensorwise", CPU, logs.append, capability=(8, 0), matmul_dtype=torch.bfloat16)
    assert out.recipe == "off" and out.fallback == "this GPU has compute capability 8.0"
    assert logs[-1].endswith("this GPU has compute capability 8.0: training in bfloat16 matrix products instead")
    monkeypatch.setitem(sys.modules, "torchao", None)          # `import torchao...` raises ImportError now
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    out = apply_fp8_training(m, "rowwise", CPU, logs.append, capability=(9, 0))
    assert out.recipe == "off" and out.fallback.startswith("torchao is not importable (")
    assert "pip install 'eyas[fp8]'" in logs[-1] and logs[-1].startswith("[eyas] train: train.fp8: rowwise needs")
    assert {n: type(x) for n, x in m.named_modules()} == before
    assert apply_fp8_training(m, "off", CPU, logs.append) == Fp8Conversion("off") and len(logs) == 2


def test_a_draft_with_no_layer_of_fp8_sizes_falls_back():
    """The toy draft is 24 wide: no product fits fp8's multiples of 16."""
    pytest.importorskip("torchao.float8")
    m, _ = toy_model()
    logs: list[str] = []
    out = apply_fp8_training(m, "tensorwise", CPU, logs.append, capability=(9, 0))
    assert out.recipe == "off" and "multiples of 16" in out.fallback
    assert logs == ["[eyas] train: train.fp8: tensorwise is not used: no linear layer of this draft has in and out "
                    "features that are multiples of 16: training in bfloat16 matrix products instead"]
    assert not any(type(x).__name__ == "Float8Linear" for x in m.modules())


# ---------------------------------------------------------------- the conversion (torchao installed)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_conversion_replaces_the_layers_that_fit_and_keeps_every_key(recipe):
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    m = draft16(intermediate=40)                           # 40 is no multiple of 16: the MLP stays
    state = m.state_dict()
    params = dict(m.named_parameters())
    logs: list[str] = []
    out = apply_fp8_training(m, recipe, CPU, logs.append, capability=(9, 0))
    assert out.recipe == recipe and out.fallback is None
    assert out.layers == ("fc", *ATTN)
    assert sorted(out.kept) == sorted(MLP + ["lm_head"])
    assert {n for n, x in m.named_modules() if isinstance(x, Float8Linear)} == set(out.layers)
    assert type(m.lm_head) is torch.nn.Linear and type(m.midlayer.mlp.up_proj) is torch.nn.Linear
    # the same parameters (fp32 masters, the very objects the optimizer holds) under the same names
    assert dict(m.named_parameters()) == params
    after = m.state_dict()
    assert list(after) == list(state)
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in state.items())
    assert list(m.trainable_state_dict()) == [k for k in state if not k.startswith(("embed_tokens.", "rotary."))]
    assert len(logs) == 1 and logs[0].startswith(f"[eyas] train: fp8 ({recipe} scaling) matrix products in 5 "
                                                 f"linear layers (fc, midlayer.self_attn.q_proj,")


def test_converted_layers_run_in_the_ttt_forward_under_autocast():
    """Under bf16 autocast the TTT forward casts its plain projections once (Eagle3DecoderLayer.ttt_weights) and
    multiplies by the copies; a converted layer must run through its own forward at every step instead."""
    pytest.importorskip("torchao.float8")
    ref, m = draft16(), draft16()
    apply_fp8_training(m, "tensorwise", CPU, lambda s: None, capability=(9, 0), emulate=True)
    calls: dict[str, int] = {}
    for name in ("fc", *ATTN, *MLP):
        m.get_submodule(name).register_forward_hook(
            lambda mod, inp, out, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    g = torch.Generator().manual_seed(0)
    ids, aux = torch.randint(0, 99, (2, 16), generator=g), torch.randn(2, 16, 96, generator=g)
    out = {}
    for key, model in (("bf16", ref), ("fp8", m)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hs = model(ids, aux, 3)
        loss = sum(h.float().pow(2).mean() for h in hs)
        loss.backward()
        out[key] = loss.item()
    assert calls == {"fc": 1, **{n: 3 for n in ATTN + MLP}}          # every TTT step, every projection
    assert all(m.get_submodule(n).weight.grad.abs().sum() > 0 for n in ("fc", *ATTN, *MLP))
    assert out["fp8"] == pytest.approx(out["bf16"], rel=0.05) and out["fp8"] != out["bf16"]


class Toy16(ToySet):
    """ToySet's samples with 32-wide states (ToySet's are 24 wide, which no fp8 product fits)."""

    def __init__(self, n: int, seed: int):
        super().__init__(n, seed)
        g = torch.Generator().manual_seed(seed + 1000)
        for it in self.items:
            T = len(it["input_ids"])
            it["aux"], it["last"] = torch.randn(T, 96, generator=g), torch.randn(T, 32, generator=g)


def model16():
    """``draft16`` with the toy vocabulary and a target lm_head [99, 32], as ``toy_model`` makes them."""
    m = draft16()
    set_vocab(m, torch.randperm(99, generator=torch.Generator().manual_seed(5))[:48].sort().values)
    return m, torch.randn(99, 32, generator=torch.Generator().manual_seed(6)) * 2


def test_an_fp8_run_through_the_loop_checkpoints_plain_weights_and_resumes(tmp_path, monkeypatch):
    """The loop with fp8 taken as available (emulated on the CPU): it converts, trains close to the fp8-off run,
    writes checkpoints with the off run's tensor names and dtypes, and a stopped run resumes to the same end."""
    pytest.importorskip("torchao.float8")
    data = Toy16(6, seed=22)
    cfg = dict(epochs=2, checkpoint_every=1, lr=1e-3)
    m, head = model16()
    off = train(m, data, head, toy_cfg(**cfg), tmp_path / "off", CPU, {}, log=lambda s: None)
    monkeypatch.setattr(loop_module, "apply_fp8_training", functools.partial(
        fp8_module.apply_fp8_training, capability=(9, 0), emulate=True))
    m, head = model16()
    full = train(m, data, head, toy_cfg(fp8="tensorwise", **cfg), tmp_path / "fp8", CPU, {}, log=lambda s: None)
    assert full.fp8.recipe == "tensorwise" and full.fp8.layers == ("fc", *ATTN, *MLP)
    a, b = _losses(tmp_path / "off"), _losses(tmp_path / "fp8")
    assert [s for s, _ in b] == [s for s, _ in a] and b != a
    assert [x for _, x in b] == pytest.approx([x for _, x in a], rel=0.05)
    ck_off, ck_fp8 = (load_file(tmp_path / d / "checkpoints" / "step-00000006" / "draft.safetensors")
                      for d in ("off", "fp8"))
    assert {k: v.dtype for k, v in ck_fp8.items()} == {k: v.dtype for k, v in ck_off.items()}
    assert list(full.final_state) == list(off.final_state)

    m, head = model16()
    part = train(m, data, head, toy_cfg(fp8="tensorwise", **cfg), tmp_path / "resumed", CPU, {},
                 log=lambda s: None, should_stop=lambda step: step == 3)
    assert part.steps == 3
    m, head = model16()
    rest = train(m, data, head, toy_cfg(fp8="tensorwise", **cfg), tmp_path / "resumed", CPU, {},
                 log=lambda s: None)
    assert rest.steps == 6 and _losses(tmp_path / "resumed") == b          # fp8 rounding is deterministic too
    for k, v in full.final_state.items():
        assert torch.equal(v, rest.final_state[k]), k


# ---------------------------------------------------------------- the stage records it


@pytest.mark.e2e
def test_train_stage_records_the_fallback_in_done_json(tmp_path, shared):
    """stories260K, online, on the CPU with train.fp8=tensorwise: the stage says so and done.json records it."""
    from eyas.stages import run_stage

    ctx, logs = stories_train_run(tmp_path, shared, rows=6, fp8="tensorwise", epochs=1, batch_size=3)
    summary = run_stage(ctx, "train")
    assert FALLBACK in logs
    assert summary.fp8 == "off" and summary.fp8_fallback == "this run is on cpu"
    done = json.loads(ctx.run.done("train").read_text())["summary"]
    assert done["fp8"] == "off" and done["fp8_fallback"] == "this run is on cpu"

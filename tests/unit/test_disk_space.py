"""Issue 12, kind 5: a run whose hidden states do not fit on the disk is stopped before it starts: `eyas plan` warns
and names the cheaper choices with their sizes; extract states the bytes it will write and refuses to start when
the store's disk cannot hold them (extract.ignore_disk_space overrides).

The target is Kimi-K2-sized (its published config.json: 61 layers, hidden 7168; no weights, and for extract, which
checks the target's checkpoint first, safetensors headers whose data are holes) with stories260K's tokenizer, as in
tests/e2e/test_families.py's plan test; the free space is the real free space of the disk."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from typer.testing import CliRunner

from eyas.cli import app
from eyas.config import load_config
from eyas.errors import StoreError
from eyas.families import FAMILIES
from eyas.plan import human_bytes, plan
from eyas.records import TokenizedSample
from eyas.stages import RunContext, init_run_dir, run_stage
from eyas.store.space import check_disk_space, disk_free
from tiny import header_only_checkpoint

KIMI_BYTES_PER_TOKEN = 4 * 7168 * 2 + 4          # 3 aux + last state in bf16, int32 id


def _kimi_target(tmp_path, stories_dir):
    target = tmp_path / "kimi-k2-shape"
    target.mkdir()
    # model_type deepseek_v3: transformers runs Kimi-K2 as DeepSeek-V3 (kimi_k2 needs remote code)
    (target / "config.json").write_text(json.dumps(
        {**FAMILIES["deepseek_v3"].reference["Kimi-K2-Instruct"], "model_type": "deepseek_v3"}))
    for f in stories_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, target / f.name)
    return target


def _kimi_head_and_layers() -> dict[str, tuple[str, list[int]]]:
    """What the target check requires of a Kimi-K2 checkpoint: embedding, lm_head, final norm, a tensor per layer."""
    c = FAMILIES["deepseek_v3"].reference["Kimi-K2-Instruct"]
    V, H = c["vocab_size"], c["hidden_size"]
    t = {"model.embed_tokens.weight": ("BF16", [V, H]), "lm_head.weight": ("BF16", [V, H]),
         "model.norm.weight": ("BF16", [H])}
    return t | {f"model.layers.{i}.input_layernorm.weight": ("BF16", [H]) for i in range(c["num_hidden_layers"])}


def _config(tmp_path, target, data, **sections):
    cfg = {"run_dir": str(tmp_path / "run"), "target": {"model": str(target)},
           "prepare": {"sources": [{"path": str(data), "format": "prompts"}]}}
    for k, v in sections.items():
        cfg.setdefault(k, {}).update(v)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_plan_warns_past_the_free_space_and_names_cheaper_choices(tmp_path, stories_dir):
    # The report's case: 100,000 prompts, 64K context, replies regenerated up to the context.
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Tell story number {i} about a red fox."}) + "\n"
                            for i in range(100_000)))
    cfg_path = _config(tmp_path, _kimi_target(tmp_path, stories_dir), data,
                       generate={"max_new_tokens": 65_536}, tokenize={"max_length": 65_536})
    p = plan(load_config(cfg_path), sample=20)
    assert p.dataset_samples == 100_000 and p.mean_tokens_per_sample == 65_536
    assert p.store_bytes == 100_000 * 65_536 * KIMI_BYTES_PER_TOKEN       # 376 TB
    _, free = disk_free(tmp_path)
    assert p.store_free_bytes == pytest.approx(free, rel=0.01) and p.store_bytes > free
    assert len(p.warnings) == 1 and "extract will refuse to start" in p.warnings[0]
    fp8 = 100_000 * 65_536 * (3 * (7168 + 4) + 7168 * 2 + 4)
    assert p.cheaper == {
        "extract.aux_format: float8_e4m3fn": fp8,
        # fp8 aux states and the target's top 32 draft ids in place of the last state: 0.38x of bf16
        "extract.labels: topk (label_topk 32, with fp8 aux states)": 100_000 * 65_536 * (3 * (7168 + 4) + 4 + 129),
        "train.mode: online (the target runs in the training job; nothing stored)": 0,
        "tokenize.max_length: 32768": p.store_bytes // 2,
        "tokenize.max_length: 16384": p.store_bytes // 4,
    }
    assert human_bytes(fp8) in p.warnings[0] and "train.mode: online" in p.warnings[0]

    out = CliRunner().invoke(app, ["plan", str(cfg_path), "--sample", "20"])
    assert out.exit_code == 0 and "WARNING" in out.output and "cheaper" in out.output, out.output
    # online training stores nothing: no warning
    assert plan(load_config(cfg_path, ["train.mode=online"]), sample=20).warnings == []


def test_extract_refuses_to_start_when_the_store_does_not_fit(tmp_path, stories_dir, shared):
    where, free = disk_free(tmp_path)
    if free > 2e12:
        pytest.skip(f"{where} has {human_bytes(free)} free: too many tokens to describe a dataset that fills it")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in ("Once upon a time", "The cat sat")))
    logs: list[str] = []
    target = _kimi_target(tmp_path, stories_dir)
    try:   # extract checks the target's checkpoint first: headers of Kimi-K2's shape, the data left as holes
        header_only_checkpoint(target, _kimi_head_and_layers(), shards=64)
    except OSError as e:
        pytest.skip(str(e))
    ctx = RunContext(cfg=load_config(_config(tmp_path, target, data, generate={"enabled": False})), log=logs.append)
    init_run_dir(ctx, ["test"])
    run_stage(ctx, "prepare")
    # A tokenized dataset one and a half times the free space (64K-token samples), as tokenize would write it.
    tokens = int(free / KIMI_BYTES_PER_TOKEN * 1.5)
    samples = [TokenizedSample(f"s{i}", [i % 500] * 65_536, [1] * 65_536) for i in range(tokens // 65_536 + 1)]
    (tmp_path / "run" / "tokenize").mkdir(parents=True)
    (tmp_path / "run" / "tokenize" / "samples.jsonl").write_text(
        "".join(json.dumps(s.to_json()) + "\n" for s in samples))
    (tmp_path / "run" / "tokenize" / "meta.json").write_text(json.dumps({"tokenizer": {"name_or_path": "t"}}))
    # ... and marked finished with this configuration, as tokenize would (extract checks its input first)
    from tiny import mark_done

    mark_done(ctx, "tokenize", {"samples": len(samples), "tokens": len(samples) * 65_536,
                                "assistant_tokens": len(samples) * 65_536, "truncated": 0, "skipped": 0})
    with pytest.raises(StoreError, match=r"extract needs .* free\. Refused before writing anything.*"
                                         r"extract\.ignore_disk_space: true"):
        run_stage(ctx, "extract")
    assert any(m.startswith("[eyas] extract: will write") for m in logs), logs
    assert not (tmp_path / "run" / "extract" / "store").exists()


def test_ignore_disk_space_goes_on_with_a_warning(tmp_path):
    _, free = disk_free(tmp_path)
    logs: list[str] = []
    assert check_disk_space(free * 2, tmp_path / "x", ignore=True, what="extract", log=logs.append) > 0
    assert "going on (extract.ignore_disk_space)" in logs[0]
    with pytest.raises(StoreError):
        check_disk_space(free * 2, tmp_path / "x", ignore=False, what="extract", log=logs.append)
    assert check_disk_space(1, tmp_path / "x", ignore=False, what="extract", log=logs.append) > 0

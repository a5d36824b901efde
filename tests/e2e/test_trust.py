"""Issue 12, kind 1: nothing stale, foreign or corrupt reaches training (the real stories260K target).

Before its first step, a stage checks that every input was made by this run with the configuration in force and
names what changed; the store must be this run's and whole, and every sample's bytes are re-hashed as they are
read; a refused command writes nothing; ``--force`` clears only what depends on the stage."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from typer.testing import CliRunner

from eyas.cli import app
from eyas.config import load_config
from eyas.errors import EyasError, StoreError
from eyas.stages import RunContext, run_stage
from eyas.store.shards import read_safetensors_header

pytestmark = pytest.mark.e2e

UPSTREAM = ["prepare", "generate", "tokenize", "vocab", "extract"]


def _config(tmp_path, shared, name: str, layer_ids=(1, 2, 3), draft_vocab_size=300):
    stories = shared / "models" / "stories260K"
    cfg = {
        "run_dir": str(tmp_path / name),
        "target": {"model": str(stories / "stories260K.bin"), "tokenizer": str(stories / "tok512.bin")},
        "prepare": {"sources": [{"path": str(shared / "data" / "train" / "gsm8k_train.jsonl"), "max_rows": 6}]},
        "generate": {"enabled": False},
        "tokenize": {"max_length": 160},
        "vocab": {"draft_vocab_size": draft_vocab_size},
        "extract": {"layer_ids": list(layer_ids), "dtype": "float32"},
        "train": {"ttt_steps": 2, "epochs": 1, "batch_size": 3, "checkpoint_every": 100, "tensorboard": False},
        "export": {"formats": ["sglang"]},
    }
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def _ctx(path, overrides=None, **kw) -> RunContext:
    return RunContext(cfg=load_config(path, overrides), log=lambda m: None, argv=["test"], **kw)


@pytest.fixture(scope="module")
def made(tmp_path_factory, shared):
    """A run folder with prepare .. extract done (copied per test)."""
    root = tmp_path_factory.mktemp("trust")
    path = _config(root, shared, "base")
    ctx = _ctx(path)
    for s in UPSTREAM:
        run_stage(ctx, s)
    return root


def _copy(made, tmp_path, shared, name="run", **kw):
    shutil.copytree(made / "base", tmp_path / name)
    path = _config(tmp_path, shared, name, **kw)
    return path


def test_another_runs_store_is_refused_by_train(made, tmp_path, shared):
    # the same configuration in another run folder: its store's run id is not this run's
    path = _copy(made, tmp_path, shared)
    other = tmp_path / "other"
    shutil.copytree(made / "base", other)
    (other / "run.json").write_text(json.dumps({"run_id": "f" * 32}))     # a run of its own ...
    shutil.rmtree(other / "extract")
    ctx = _ctx(_config(tmp_path, shared, "other"))
    shutil.copytree(tmp_path / "run" / "extract", other / "extract")          # ... holding the first run's store
    with pytest.raises(StoreError, match=r"another run or configuration \(run_id: store '[0-9a-f]+', this run "
                                         r"'f{32}'\).*eyas extract CONFIG --force"):
        run_stage(ctx, "train")
    assert not (other / "train").exists()
    # other layer ids: the input check names the field before the store is opened
    ctx = _ctx(path, ["extract.layer_ids=[2, 3, 4]"])
    with pytest.raises(EyasError, match=r"reads .*extract, which was made with another configuration "
                                        r"\(extract.layer_ids: \[1, 2, 3\] -> \[2, 3, 4\]\).*eyas extract CONFIG --force"):
        run_stage(ctx, "train")


def _first_sample_aux(store_root):
    shard = sorted((store_root / "shards").glob("*.safetensors"))[0]
    raw, meta = read_safetensors_header(shard)
    name = next(k for k in meta if k.endswith(".aux"))
    return shard, len(raw), meta[name]["data_offsets"], name.split(".")[0]


def test_a_flipped_byte_stops_training_naming_the_sample(made, tmp_path, shared):
    path = _copy(made, tmp_path, shared)
    shard, head, (a, b), sid = _first_sample_aux(tmp_path / "run" / "extract" / "store")
    data = bytearray(shard.read_bytes())
    data[head + a + 5] ^= 0x01                                            # one bit of one aux value
    shard.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=rf"sample {sid}: its stored bytes .* differ from the checksum.*doctor"):
        run_stage(_ctx(path), "train")


def test_a_truncated_shard_is_refused_before_the_first_step(made, tmp_path, shared):
    path = _copy(made, tmp_path, shared)
    shard, *_ = _first_sample_aux(tmp_path / "run" / "extract" / "store")
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(StoreError, match=rf"{shard.name}.*size .* differs from the manifest.*eyas doctor RUN --repair"):
        run_stage(_ctx(path), "train")
    assert not (tmp_path / "run" / "train" / "metrics.jsonl").exists()


def test_force_on_train_with_a_stale_vocabulary_refuses_and_writes_nothing(made, tmp_path, shared):
    path = _copy(made, tmp_path, shared)
    run = tmp_path / "run"
    before = {f: (run / f).read_bytes() for f in ("config.yaml", "environment.json", "run.json")}
    out = CliRunner().invoke(app, ["train", str(path), "vocab.draft_vocab_size=200", "--force"])
    assert out.exit_code == 2, out.output
    text = " ".join(out.output.split())
    assert "vocab.draft_vocab_size: 300 -> 200" in text and "eyas vocab CONFIG --force" in text, text
    assert {f: (run / f).read_bytes() for f in before} == before          # a refused command wrote nothing
    assert not (run / "train").exists()


def test_vocab_force_keeps_the_store_that_does_not_depend_on_it(made, tmp_path, shared):
    path = _copy(made, tmp_path, shared)
    run = tmp_path / "run"
    shards = sorted((run / "extract" / "store" / "shards").iterdir())
    out = CliRunner().invoke(app, ["vocab", str(path), "vocab.draft_vocab_size=200", "--force"])
    assert out.exit_code == 0, out.output
    assert json.loads((run / "vocab" / "vocab.json").read_text())["draft_vocab_size"] == 200
    assert sorted((run / "extract" / "store" / "shards").iterdir()) == shards     # extract does not read vocab
    assert (run / "extract" / "done.json").exists()
    # and training now runs on the new vocabulary
    s = run_stage(_ctx(path, ["vocab.draft_vocab_size=200"]), "train")
    assert s.steps >= 1
    assert json.loads((run / "train" / "final" / "draft_config.json").read_text())["draft"]["draft_vocab_size"] == 200

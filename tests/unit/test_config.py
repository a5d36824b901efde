import pytest

from eyas.config import load_config, resolve_path
from eyas.data.formats import load_source
from eyas.errors import ConfigError
from eyas.records import SkipCounter

BASE = """
run_dir: runs/x
target: {model: some/folder}
prepare: {sources: [{path: a.jsonl}]}
"""


def _write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_demo_config_names_files_that_ship():
    """`eyas run demo` works from an installed package: every pkg: path of the demo resolves to a shipped file, and
    the prompt files load and are not empty."""
    cfg = load_config("demo")
    assert resolve_path(cfg.target.model).is_file(), cfg.target.model
    for src in cfg.prepare.sources + cfg.evaluate.prompts:
        assert src.path.startswith("pkg:eyas/") and resolve_path(src.path).is_file(), src.path
        assert next(iter(load_source(src, SkipCounter(), {})), None) is not None, src.path


def test_overrides_are_typed(tmp_path):
    cfg = load_config(_write(tmp_path, BASE), ["train.lr=3e-4", "train.ttt_steps=3", "export.formats=[sglang]"])
    assert cfg.train.lr == 3e-4 and cfg.train.ttt_steps == 3


def test_unknown_key_and_bad_value_reported_together(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, BASE + "train: {ttt_step: 3, lr: -1}\n"))
    msg = str(e.value)
    assert "train.ttt_step" in msg and "train.lr" in msg and "2 invalid" in msg


def test_missing_file_and_bad_override(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_config(_write(tmp_path, BASE), ["train.lr"])


def test_a_key_written_twice_is_an_error_naming_both_lines(tmp_path):
    text = BASE + "train: {lr: 1.0e-4}\nexport: {formats: [sglang]}\ntrain: {ttt_steps: 3}\n"
    with pytest.raises(ConfigError, match=r"key 'train' is written twice in one mapping \(lines 5 and 7\)"):
        load_config(_write(tmp_path, text))
    with pytest.raises(ConfigError, match=r"key 'lr' is written twice"):
        load_config(_write(tmp_path, BASE + "train:\n  lr: 1.0\n  lr: 2.0\n"))


def test_every_bad_optimizer_and_draft_setting_is_reported_at_once(tmp_path):
    text = BASE + ("train:\n  betas: [0.9, 1.5]\n  draft: {hidden_size: -64, num_attention_heads: 0}\n"
                   "  lr: -1\n")
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, text))
    msg = str(e.value)
    assert "4 invalid" in msg and "train.betas" in msg and "beta2=1.5" in msg
    assert "train.draft.hidden_size" in msg and "train.draft.num_attention_heads" in msg and "train.lr" in msg
    with pytest.raises(ConfigError, match="num_attention_heads \\(12\\) must be a multiple of num_key_value_heads"):
        load_config(_write(tmp_path, BASE + "train: {draft: {num_attention_heads: 12, num_key_value_heads: 5}}\n"))
    with pytest.raises(ConfigError, match="hidden_size \\(100\\) must be a multiple of num_attention_heads"):
        load_config(_write(tmp_path, BASE + "train: {draft: {hidden_size: 100, num_attention_heads: 8}}\n"))
    cfg = load_config(_write(tmp_path, BASE + "train: {draft: {hidden_size: 100, num_attention_heads: 8, "
                                              "head_dim: 16}, betas: [0.0, 0.999]}\n"))
    assert cfg.train.draft.num_attention_heads == 8 and cfg.train.betas == (0.0, 0.999)

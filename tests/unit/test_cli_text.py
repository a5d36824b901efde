"""The command line prints messages as they are written: a setting in brackets (``export.formats: [vllm]``) or a
shape (``[B, T]``) in an error or a table cell is user data, not Rich markup, and must reach the user whole."""

import json

from typer.testing import CliRunner

from eyas.cli import _console, app


def test_config_error_keeps_bracketed_settings(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({"target": {"model": "t"}, "prepare": {"sources": [{"path": "p.jsonl"}]},
                               "train": {"draft": {"num_hidden_layers": 2}}}))
    res = CliRunner().invoke(app, ["show-config", str(cfg)], env={"COLUMNS": "400"})
    assert res.exit_code == 2
    text = " ".join(res.output.split())          # the console wraps long lines
    assert "error:" in text
    assert "set export.formats: [vllm], which serves any depth" in text


def test_console_prints_brackets_literally(capsys):
    _console().print("aux [B, T, 3*Ht] from [vllm] in [bold]x[/bold]")
    assert capsys.readouterr().out.strip() == "aux [B, T, 3*Ht] from [vllm] in [bold]x[/bold]"

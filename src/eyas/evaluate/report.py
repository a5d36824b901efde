"""``eyas report RUN``: one self-contained HTML page describing a run, with its figures as PNG files beside it.

Sections: the resolved configuration (``RUN/config.yaml``) and environment; the data report (each finished stage's
``done.json`` summary: prepare, generate, tokenize, vocab, extract); training curves from ``train/metrics.jsonl``
(total loss, per-TTT-step loss and accuracy against the optimizer step); acceptance from ``evaluate/results.json``
(rate per draft position, acceptance length per prompt set; the drafter beside n-gram lookup per set and per
category, with each category's table); and the exact commands that serve the exported folders
with SGLang and vLLM. Figures are drawn with matplotlib (Agg backend) into ``RUN/report/*.png``.
"""

from __future__ import annotations

import html
import json
import shlex
from pathlib import Path

from ..config import TrainConfig
from ..errors import EyasError
from ..io import read_json, write_text_atomic
from ..run_folder import RunFolder
from ..summaries import read_done
from ..train.metrics import StepMetrics, read_metrics

DATA_STAGES = ["prepare", "generate", "tokenize", "vocab", "extract"]


def plot_training(rows: list[StepMetrics], out: Path, ttt_decay: float) -> Path | None:
    """Loss (total and per TTT step) and per-step accuracy against the optimizer step; ``None`` without rows.
    ``ttt_decay``: the run's ``train.ttt_decay`` (step i of the total loss is weighted ``ttt_decay**i``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        return None
    steps = [r.step for r in rows]
    k = len(rows[0].acc_k)
    fig, (a0, a1, a2) = plt.subplots(1, 3, figsize=(14, 4))
    a0.plot(steps, [r.loss for r in rows], color="black", label="train")
    evals = [r for r in rows if r.eval_loss is not None]
    if evals:
        a0.plot([r.step for r in evals], [r.eval_loss for r in evals], "o--", color="gray", label="eval")
    nan = float("nan")
    for i in range(k):
        a1.plot(steps, [r.loss_k[i] if i < len(r.loss_k) else nan for r in rows], lw=0.9, label=f"step {i}")
        a2.plot(steps, [r.acc_k[i] if i < len(r.acc_k) else nan for r in rows], lw=0.9, label=f"step {i}")
    a0.set(xlabel="optimizer step", ylabel="loss", title=f"total loss ({ttt_decay:g}^i-weighted sum over TTT steps)")
    a1.set(xlabel="optimizer step", ylabel="cross-entropy", title="loss per TTT step")
    a2.set(xlabel="optimizer step", ylabel="top-1 accuracy (draft vocab)", title="accuracy per TTT step", ylim=(0, 1))
    for a in (a0, a1, a2):
        a.legend(fontsize=7)
    fig.tight_layout()
    p = out / "training.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def plot_acceptance(results: dict, out: Path) -> Path | None:
    """Acceptance rate per draft position (one line per set) and acceptance length per set (bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = results.get("sets") or {}
    if not sets:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, s in sets.items():
        rate = s["acceptance_rate_per_position"]
        a1.plot(range(1, len(rate) + 1), rate, "o-", label=name)
    a1.set(xlabel="draft position", ylabel="accepted / rounds", ylim=(0, 1),
           title=f"acceptance per position ({results.get('engine', 'reference')})")
    a1.set_xticks(range(1, results.get("num_draft_tokens", 1) + 1))
    a1.legend(fontsize=8)
    names = list(sets)
    vals = [sets[n]["acceptance_length"] for n in names]
    bars = a2.bar(names, vals, color="#4a7ab0")
    a2.bar_label(bars, labels=[f"{v:.2f}" for v in vals], fontsize=8)
    a2.axhline(1.0, color="gray", lw=0.8, ls="--")
    a2.set(ylabel="acceptance length (tokens per target pass)", title="acceptance length per set",
           ylim=(0, max(vals + [1.0]) * 1.15))
    fig.tight_layout()
    p = out / "acceptance.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def plot_versus_ngram(results: dict, out: Path) -> Path | None:
    """Tokens per target step of the drafter and of n-gram lookup (and suffix decoding, where measured) side by
    side: one panel of every set, then one panel per set with categories (``sets[name]["categories"]``, :func:`eyas.stages.evaluate.category_summaries`).
    A drafter bar is labelled with its gain over n-gram lookup and drawn hatched where that gain is below
    ``results["ngram_margin"]``. ``None`` without sets; sets or categories without n-gram counts get the drafter's
    bar alone. Writes ``out/versus_ngram.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = results.get("sets") or {}
    if not sets:
        return None
    margin = results.get("ngram_margin")
    panels = [("per set", sets)] + [(f"{n} per category", s["categories"]) for n, s in sets.items()
                                     if s.get("categories")]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.8 * len(panels)), squeeze=False)
    series = [("ngram", "n-gram lookup (no training)", "#c8a040"), ("suffix", "suffix decoding (no training)", "#8fb070")]
    for ax, (title, groups) in zip(axes[:, 0], panels):
        names = list(groups)
        shown = [m for m in series if any(groups[n].get(m[0]) for n in names)]   # baselines measured here
        w = 0.8 / (1 + len(shown))
        x = [i - 0.4 + w / 2 for i in range(len(names))]
        mine = [_tokens_per_step(groups[n]) for n in names]
        bars = ax.bar(x, mine, w, color="#4a7ab0", label="Eyas drafter", edgecolor="black", linewidth=0.4)
        gains = [groups[n].get("gain_over_ngram") for n in names]
        ax.bar_label(bars, labels=[f"{v:.2f}" + (f" ({g:.2f}x)" if g is not None else "") for v, g in zip(mine, gains)],
                     fontsize=7)
        tops = list(mine)
        for j, (key, label, color) in enumerate(shown, 1):
            vals = [_tokens_per_step(groups[n][key]) if groups[n].get(key) else 0.0 for n in names]
            nb = ax.bar([v + j * w for v in x], vals, w, color=color, label=label, edgecolor="black", linewidth=0.4)
            ax.bar_label(nb, labels=[f"{v:.2f}" if v else "" for v in vals], fontsize=7)
            tops += vals
        ax.legend(fontsize=7, loc="upper right")
        for b, g in zip(bars, gains):        # after the legend, whose swatch would take the first bar's hatch
            if margin is not None and g is not None and g < margin:
                b.set_hatch("//")
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xticks(range(len(names)), names, rotation=20 if len(names) > 4 else 0, fontsize=8)
        ax.set(ylabel="tokens per target step", ylim=(0, max(tops + [1.0]) * 1.2),
               title=f"drafter vs n-gram lookup, {title} ({results.get('engine', 'reference')})"
                     + (f"; hatched: below {margin:g}x n-gram" if margin is not None else ""))
    fig.tight_layout()
    p = out / "versus_ngram.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def _tokens_per_step(s: dict) -> float:
    """A set's or category's tokens per target step (results written before it existed: acceptance length)."""
    v = s.get("tokens_per_target_step")
    return float(v if v is not None else s["acceptance_length"])


def _baseline_cell(s: dict, key: str = "ngram") -> str:
    """A baseline's (``ngram``, ``suffix``) tokens per target step of a set or category, or '-' where not measured."""
    return f"{_tokens_per_step(s[key]):.3f}" if s.get(key) else "-"


def _category_table(name: str, s: dict, margin: float | None) -> str:
    """HTML table of one set's categories: prompts, rounds, acceptance length and tokens per target step of the
    drafter and of n-gram lookup, and their ratio (bold where below ``margin``)."""
    head = ("<tr><th>category</th><th>prompts</th><th>rounds</th><th>acceptance length</th>"
            "<th>tokens per target step: drafter</th><th>n-gram lookup</th><th>drafter / n-gram</th>"
            "<th>suffix decoding</th></tr>")
    rows = []
    for cat, c in s["categories"].items():
        gain = c.get("gain_over_ngram")
        ratio = "-" if gain is None else (f"<b>{gain:.2f}x</b>" if margin is not None and gain < margin
                                          else f"{gain:.2f}x")
        rows.append(f"<tr><td>{html.escape(cat)}</td><td>{c['prompts']}</td><td>{c['rounds']}</td>"
                    f"<td>{c['acceptance_length']:.3f}</td><td>{_tokens_per_step(c):.3f}</td>"
                    f"<td>{_baseline_cell(c)}</td><td>{ratio}</td><td>{_baseline_cell(c, 'suffix')}</td></tr>")
    return f"<h3>{html.escape(name)} per category</h3><table>{head}{''.join(rows)}</table>"


def serve_commands(run_dir: Path, target_dir: str, k: int) -> dict[str, str]:
    """The exact commands serving the exported folders (FIELD_NOTES "Checkpoints the engines load";
    vLLM's ``vllm serve`` equals ``python -m vllm.entrypoints.openai.api_server``). Servers bind 127.0.0.1."""
    run = RunFolder(run_dir)
    cmds = {}
    sg = run.export("sglang").resolve()
    if sg.exists():
        cmds["SGLang"] = " ".join([
            "python -m sglang.launch_server", "--model-path", shlex.quote(target_dir), "--host 127.0.0.1 --port 30000",
            "--speculative-algorithm EAGLE3", "--speculative-draft-model-path", shlex.quote(str(sg)),
            f"--speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}",
            "--dtype bfloat16"])
    for name in ("vllm", "sglang"):
        d = run.export(name).resolve()
        if d.exists():
            spec = json.dumps({"method": "eagle3", "model": str(d), "num_speculative_tokens": k})
            cmds[f"vLLM ({name} folder)"] = " ".join([
                "vllm serve", shlex.quote(target_dir), "--host 127.0.0.1 --port 8000 --dtype bfloat16",
                "--speculative-config", shlex.quote(spec)])
    return cmds


def _table(d: dict) -> str:
    rows = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(_fmt(v))}</td></tr>" for k, v in d.items())
    return f"<table>{rows}</table>"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v)[:400]
    return str(v)


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    """Write ``report.html`` (+ PNGs) for ``run_dir`` into ``out`` (default ``RUN/report``); return the page.
    Raises :class:`EyasError` when ``run_dir`` is not an Eyas run (no ``run.json``/``config.yaml``)."""
    import yaml

    run = RunFolder(run_dir)
    if not run.config_yaml.exists():
        raise EyasError(f"{run_dir}: not an Eyas run directory (no config.yaml); give the config's run_dir")
    out = out or run.report
    out.mkdir(parents=True, exist_ok=True)
    cfg_text = run.config_yaml.read_text()
    cfg = yaml.safe_load(cfg_text)
    parts = [f"<h1>Eyas run {html.escape(str(run_dir))}</h1>"]
    if run.environment_json.exists():
        parts.append("<h2>Environment</h2>" + _table(read_json(run.environment_json)))
    parts.append("<h2>Data</h2>")
    for st in DATA_STAGES:
        if run.done(st).exists():
            summary, seconds = read_done(run, st)
            parts.append(f"<h3>{st} ({seconds or 0:.1f} s)</h3>" + _table(summary.to_json()))
    parts.append("<h2>Training</h2>")
    rows = read_metrics(run.train_metrics)
    if run.done("train").exists():
        parts.append(_table(read_done(run, "train")[0].to_json()))
    decay = (cfg.get("train") or {}).get("ttt_decay", TrainConfig.model_fields["ttt_decay"].default)
    fig = plot_training(rows, out, float(decay))
    parts.append(f'<img src="{fig.name}" alt="training curves">' if fig else "<p>no training metrics</p>")
    parts.append("<h2>Acceptance</h2>")
    if run.evaluation.exists():
        res = read_json(run.evaluation)
        parts.append(_table({k: v for k, v in res.items() if k != "sets"}))
        head = "<tr><th>set</th><th>prompts</th><th>rounds</th><th>acceptance length</th><th>rate per position</th>" \
               "<th>speedup estimate</th><th>tokens per target step: drafter</th><th>n-gram lookup</th>" \
               "<th>suffix decoding</th></tr>"
        body = "".join(
            f"<tr><td>{html.escape(n)}</td><td>{s['prompts']}</td><td>{s['rounds']}</td>"
            f"<td>{s['acceptance_length']:.3f}</td><td>{' '.join(f'{a:.2f}' for a in s['acceptance_rate_per_position'])}"
            f"</td><td>{s.get('speedup_estimate', '-')}</td><td>{_tokens_per_step(s):.3f}</td>"
            f"<td>{_baseline_cell(s)}</td><td>{_baseline_cell(s, 'suffix')}</td></tr>"
            for n, s in res.get("sets", {}).items())
        parts.append(f"<table>{head}{body}</table>")
        fig = plot_acceptance(res, out)
        if fig:
            parts.append(f'<img src="{fig.name}" alt="acceptance">')
        margin = res.get("ngram_margin")
        if res.get("categories_below_ngram_margin") is not None:
            below = res["categories_below_ngram_margin"]
            parts.append(f"<p>categories where the drafter is below {margin:g}x n-gram lookup's tokens per target "
                         f"step: {html.escape(', '.join(below)) if below else 'none'}</p>")
        parts += [_category_table(n, s, margin) for n, s in res.get("sets", {}).items() if s.get("categories")]
        fig = plot_versus_ngram(res, out)
        if fig:
            parts.append(f'<img src="{fig.name}" alt="drafter vs n-gram lookup per set and category">')
    else:
        parts.append("<p>not evaluated yet (eyas evaluate CONFIG)</p>")
    parts.append("<h2>Serve</h2>")
    target = cfg.get("target", {}).get("model", "TARGET")
    try:
        from ..config import TargetConfig
        from ..targets.load import materialize_target

        target = str(materialize_target(TargetConfig(**cfg["target"])).resolve())
    except Exception:   # the page still renders without the converted target; the command names the config's
        pass
    k = (cfg.get("export") or {}).get("num_speculative_tokens") or (cfg.get("evaluate") or {}).get(
        "num_draft_tokens", 3)
    cmds = serve_commands(run_dir, target, int(k))
    parts += [f"<h3>{html.escape(n)}</h3><pre>{html.escape(c)}</pre>" for n, c in cmds.items()] or [
        "<p>no exported folder yet (eyas export CONFIG)</p>"]
    parts.append(f"<h2>Configuration</h2><pre>{html.escape(cfg_text)}</pre>")
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse;"
             "margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 8px;font-size:13px;text-align:left}"
             "pre{background:#f4f4f4;padding:8px;white-space:pre-wrap}img{max-width:100%}")
    page = out / "report.html"
    write_text_atomic(page, f"<!doctype html><html><head><meta charset='utf-8'><title>Eyas {html.escape(run.root.name)}"
                            f"</title><style>{style}</style></head><body>{''.join(parts)}</body></html>\n")
    return page

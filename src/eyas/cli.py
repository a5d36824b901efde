"""The ``eyas`` command: one sub-command per stage, plus ``run`` for the whole pipeline.

Every command takes a CONFIG (a YAML path, or ``demo`` for the embedded demo) and ``key.sub=value`` overrides
after it, e.g. ``eyas train demo train.lr=3e-4 train.epochs=2``. Outputs go to the config's ``run_dir``; a stage
that already finished with the same configuration is skipped, partial work is resumed.
"""

from __future__ import annotations

import sys
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .config import load_config
from .errors import EyasError
from .run_folder import STAGES, RunFolder
from .run_lock import hold_run_folder
from .stages import RunContext, run_stage, run_stages, stage_module, stage_seconds

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help=(
        "Eyas trains EAGLE-3 speculative-decoding drafters: prompts + a target model -> a drafter SGLang and vLLM "
        "serve, with its acceptance length measured.\n\n"
        "Pipeline: prepare -> generate -> tokenize -> vocab -> extract -> train -> export -> evaluate.\n\n"
        "Start with `eyas run demo` (SmolLM2-135M-Instruct on the shipped prompts), then copy the demo config "
        "(`eyas show-config demo > my.yaml`) and point it at your target and data."
    ),
)


def _console(stderr: bool = False) -> Console:
    """A console that prints text as given. Messages and table cells carry user data (paths, list settings such as
    ``export.formats: [vllm]``, tensor shapes such as ``[B, T]``) that Rich's markup would read as style tags and
    drop; styles are given as arguments instead."""
    return Console(stderr=stderr, markup=False)


console = _console(stderr=True)


def _log(message: str) -> None:
    """A stage's or command's progress line, on stderr."""
    console.print(message, highlight=False)


CONFIG_HELP = "Run config: a YAML file, or 'demo' for the embedded demo."
OVERRIDES_HELP = "Overrides of single fields, as key.sub=value (value parsed as YAML)."


def _ctx(config: str, overrides: list[str] | None, force: bool, redo: frozenset[str] = frozenset()) -> RunContext:
    cfg = load_config(config, overrides)
    # the run folder is described (run.json, config.yaml, environment.json) when a stage starts: a refused command
    # writes nothing
    return RunContext(cfg=cfg, force=force, redo=redo, argv=list(sys.argv), log=_log)


def _writing(ctx: RunContext):
    """The run folder's writer lock (:mod:`eyas.run_lock`), held while a command writes it: a second command on
    the same run is refused before it writes anything, naming the holder."""
    return hold_run_folder(ctx.run, ctx.argv or [], ctx.log)


def _fail(e: Exception) -> None:
    console.print(Text.assemble(("error:", "bold red"), " ", str(e)), highlight=False)
    raise typer.Exit(code=2)


def _stage_command(stage: str):
    def command(
        config: str = typer.Argument(..., help=CONFIG_HELP),
        overrides: Optional[list[str]] = typer.Argument(None, help=OVERRIDES_HELP),
        force: bool = typer.Option(False, "--force", help=f"Redo '{stage}' (and clear every later stage)."),
    ) -> None:
        try:
            ctx = _ctx(config, overrides, force, redo=frozenset({stage}))
            with _writing(ctx):
                summary = run_stage(ctx, stage)
            console.print_json(data=summary.to_json())
        except EyasError as e:
            _fail(e)

    command.__doc__ = f"Run only the '{stage}' stage (earlier stages must have finished)."
    return command


def _train_command():
    run_train = _stage_command("train")

    def command(
        config: str = typer.Argument(..., help=CONFIG_HELP),
        overrides: Optional[list[str]] = typer.Argument(None, help=OVERRIDES_HELP),
        force: bool = typer.Option(False, "--force", help="Redo 'train' (and clear every later stage)."),
        init_from: Optional[str] = typer.Option(
            None, "--init-from", help="Fine-tune this drafter folder (Eyas train/final or SGLang format), keeping "
            "its draft vocabulary (d2t), or moving it onto the run's with train.init_vocab=run; same as "
            "train.init_from=DRAFTER."),
    ) -> None:
        import json

        extra = [f"train.init_from={json.dumps(init_from)}"] if init_from else []
        run_train(config, list(overrides or []) + extra, force)

    command.__doc__ = "Run only the 'train' stage (earlier stages must have finished)."
    return command


def _export_command():
    run_export = _stage_command("export")

    def command(
        config: Optional[str] = typer.Argument(None, help=CONFIG_HELP + " Not needed with --check."),
        overrides: Optional[list[str]] = typer.Argument(None, help=OVERRIDES_HELP),
        force: bool = typer.Option(False, "--force", help="Redo 'export' (and clear every later stage)."),
        check: Optional[str] = typer.Option(None, "--check", help="Check a draft folder (any trainer's) as SGLang "
                                                                   "and vLLM would read it, and stop."),
        target: Optional[str] = typer.Option(None, "--target", help="With --check: the target's HF folder (its "
                                                                     "depth, width, vocabulary and RoPE are checked)."),
        engine: Optional[str] = typer.Option(None, "--engine", help="With --check: sglang, vllm or both: the "
                                             "engines whose errors set the exit status (default: those the "
                                             "folder's layout is for: vllm for a speculators folder, both for an "
                                             "SGLang-style one)."),
    ) -> None:
        if check is None:
            if config is None:
                _fail(EyasError("give a CONFIG (or --check DIR)"))
            return run_export(config, overrides, force)
        import json
        from pathlib import Path

        from .export.check import check_folder

        if engine not in (None, "sglang", "vllm", "both"):
            _fail(EyasError(f"--engine {engine}: expected sglang, vllm or both"))
        try:
            tcfg = json.loads((Path(target) / "config.json").read_text()) if target else None
            rep = check_folder(Path(check), tcfg)
        except (EyasError, OSError) as e:
            _fail(e)
        asked = engine or rep.engines
        _console().print(rep.to_text(), highlight=False)
        ok = rep.ok_for(asked)
        _console().print(f"{'OK' if ok else 'FAIL'} for {asked if asked != 'both' else 'SGLang and vLLM'}"
                         + ("" if engine else " (the engines this layout is for; --engine to choose)"),
                         highlight=False)
        raise typer.Exit(code=0 if ok else 1)

    command.__doc__ = ("Run only the 'export' stage (export.formats: sglang, vllm), or --check DIR: what SGLang and "
                       "vLLM would skip, misread or refuse in any draft folder.")
    return command


def _evaluate_command():
    run_evaluate = _stage_command("evaluate")

    def command(
        config: str = typer.Argument(..., help=CONFIG_HELP),
        overrides: Optional[list[str]] = typer.Argument(None, help=OVERRIDES_HELP),
        force: bool = typer.Option(False, "--force", help="Redo 'evaluate'."),
        engine: Optional[str] = typer.Option(None, "--engine", help="'reference' (Eyas's decoder) or 'vllm' (a "
                                                                     "real engine); same as evaluate.engine=ENGINE."),
    ) -> None:
        run_evaluate(config, list(overrides or []) + ([f"evaluate.engine={engine}"] if engine else []), force)

    command.__doc__ = "Run only the 'evaluate' stage: acceptance length per prompt set, reference decoder or vLLM."
    return command


_COMMANDS = {"train": _train_command, "export": _export_command, "evaluate": _evaluate_command}
for _s in STAGES:
    app.command(name=_s, help=(stage_module(_s).__doc__ or "").split("\n")[0])(
        _COMMANDS[_s]() if _s in _COMMANDS else _stage_command(_s))


@app.command()
def report(
    run_dir: str = typer.Argument(..., help="A run directory (the config's run_dir)."),
    out: Optional[str] = typer.Option(None, "--out", help="Folder for the page and figures (default RUN/report)."),
) -> None:
    """One HTML page for a run: configuration, data, training curves, acceptance, serve commands."""
    from pathlib import Path

    from .evaluate.report import write_report

    try:
        page = write_report(Path(run_dir), Path(out) if out else None)
    except EyasError as e:
        _fail(e)
    _log(f"[eyas] report: {page}")


@app.command()
def run(
    config: str = typer.Argument(..., help=CONFIG_HELP),
    overrides: Optional[list[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    force: bool = typer.Option(False, "--force", help="Redo stages whose configuration changed (clears them)."),
) -> None:
    """Run every stage in order (finished stages are skipped) and print a summary table. With train.mode online
    the extract stage is not run: the target makes the states inside training and nothing is stored."""
    try:
        ctx = _ctx(config, overrides, force)
        stages = [s for s in STAGES if not (s == "extract" and ctx.cfg.train.mode == "online")]
        with _writing(ctx):
            summaries = run_stages(ctx, stages)
        print_summary(ctx, summaries)
    except EyasError as e:
        _fail(e)


@app.command("show-config")
def show_config(
    config: str = typer.Argument("demo", help=CONFIG_HELP),
    overrides: Optional[list[str]] = typer.Argument(None, help=OVERRIDES_HELP),
) -> None:
    """Print the fully resolved configuration (every field with its value) as YAML."""
    import yaml

    try:
        cfg = load_config(config, overrides)
    except EyasError as e:
        _fail(e)
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")


@app.command()
def doctor(
    path: str = typer.Argument(..., help="A run directory, or a hidden-state store folder (RUN/extract/store)."),
    repair: bool = typer.Option(False, "--repair", help="Drop exactly the bad entries and re-extract them."),
    as_json: bool = typer.Option(False, "--json", help="Print the full report as JSON."),
) -> None:
    """Re-validate a hidden-state store (checksums, shapes, finiteness, token ids, layer ids); list missing,
    corrupt and foreign samples. Exit code 1 when problems remain."""
    from contextlib import nullcontext

    from .store.doctor import diagnose, locate
    from .store.doctor import repair as repair_store

    try:
        run_dir = locate(path)[0] if repair else None
        # --repair writes the store: it is the run's one writer, from the diagnosis it repairs from to the end
        with hold_run_folder(RunFolder(run_dir), list(sys.argv), _log) if run_dir is not None else nullcontext():
            report = diagnose(path)
            _print_doctor(report, as_json)
            if repair and not report.clean:
                report = repair_store(report, log=_log)
                _log("[eyas] doctor: after repair")
                _print_doctor(report, as_json)
    except EyasError as e:
        _fail(e)
    if not report.clean:
        raise typer.Exit(code=1)


def _print_doctor(report, as_json: bool) -> None:
    if as_json:
        _console().print_json(data=report.to_json(limit=10**9))
        return
    out = _console()
    counts = report.counts()
    out.print(f"store {report.store}: {report.samples_ok} valid samples of {report.samples_listed} listed; "
              + ", ".join(f"{k} {v}" for k, v in counts.items()), highlight=False)
    if report.findings:
        t = Table(show_header=True, header_style="bold")
        for c in ("kind", "sample", "shard", "where", "reason"):
            t.add_column(c, overflow="fold")
        for f in report.findings[:40]:
            t.add_row(f.kind, f.sample or "", f.shard or "", f.where, f.reason)
        out.print(t)
        if len(report.findings) > 40:
            out.print(f"... and {len(report.findings) - 40} more (--json lists all)")


@app.command()
def plan(
    config: str = typer.Argument(..., help=CONFIG_HELP),
    overrides: Optional[list[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    sample: int = typer.Option(200, "--sample", help="Conversations of prepare.sources rendered to measure tokens."),
    prefill_tokens_per_s: Optional[float] = typer.Option(
        None, "--prefill-tokens-per-s", help="Measured prefill throughput per GPU (default: from FLOPs at 35% MFU)."),
    as_json: bool = typer.Option(False, "--json", help="Print the estimate as JSON."),
) -> None:
    """Estimate a run before it starts: tokens, hidden-state bytes (bf16 and fp8) and prefill GPU-hours, from the
    config, the target's config.json and tokenizer, and a sample of the data (no weights needed)."""
    from .plan import human_bytes
    from .plan import plan as make_plan

    try:
        p = make_plan(load_config(config, overrides), sample=sample, prefill_tokens_per_s=prefill_tokens_per_s)
    except EyasError as e:
        _fail(e)
    if as_json:
        _console().print_json(data=p.to_json())
        return
    t = Table(title=f"Eyas plan: {config}", show_header=True, header_style="bold")
    t.add_column("what")
    t.add_column("value", overflow="fold")
    t.add_row("target", f"{p.family}, {p.num_layers} layers, hidden {p.hidden_size}, vocab {p.vocab_size}, "
              f"{p.total_parameters / 1e9:.1f}B parameters ({p.active_parameters / 1e9:.1f}B active)")
    t.add_row("aux layers (output_of_layer)", f"{p.layer_ids} + last hidden state")
    t.add_row("tokens per sample", f"{p.mean_tokens_per_sample:.1f} (mean of {p.sampled_samples} rendered)")
    t.add_row("dataset", f"{p.dataset_samples} samples, {p.dataset_tokens:,} tokens")
    for k, label in (("bfloat16", "bf16"), ("fp8", "fp8 aux"), ("fp8_topk", "fp8 aux + top-k labels")):
        t.add_row(f"store, {label}", f"{p.bytes_per_token[k]:,} B/token ({p.bytes_per_token[k] / 1024:.1f} KiB); "
                  f"dataset {human_bytes(p.dataset_bytes[k])}; per 100K samples "
                  f"{human_bytes(p.bytes_per_100k_samples[k])}")
    t.add_row("prefill GPU-hours", f"dataset {p.dataset_prefill_gpu_hours:.2f}; per 100K samples "
              f"{p.prefill_gpu_hours_per_100k_samples:.2f} ({p.prefill_tokens_per_s:,.0f} tokens/s per GPU: "
              f"{p.prefill_assumption})")
    t.add_row("store as configured", f"{human_bytes(p.store_bytes)} in {p.store_path}; "
              f"{human_bytes(p.store_free_bytes)} free on its disk")
    for k, v in p.cheaper.items():
        t.add_row("cheaper", f"{k}: {human_bytes(v)}" if v else k)
    m = p.mode
    t.add_row("training mode", f"{m.recommended} (train.mode: {m.recommended}): {m.reason}; train.mode is "
              f"'{load_config(config, overrides).train.mode}' in this config")
    t.add_row("GPU-hours by mode", f"online {m.online_gpu_hours:.3g}, offline {m.offline_gpu_hours:.3g} (draft "
              f"training ~{m.train_tokens_per_s:,.0f} tokens/s per GPU)")
    for n in p.notes:
        t.add_row("note", n)
    for w in p.warnings:
        t.add_row("WARNING", w)
    _console().print(t)
    for w in p.warnings:
        console.print(f"warning: {w}", style="bold yellow", highlight=False)


def print_summary(ctx: RunContext, s: dict) -> None:
    """The end-of-run table: data, training, acceptance, and where the drafter is. ``s``: stage -> its summary."""
    out = _console()
    t = Table(title=f"Eyas run summary: {ctx.run.root}", show_header=True, header_style="bold")
    t.add_column("what")
    t.add_column("value", overflow="fold")
    t.add_column("stage time", justify="right")

    def secs(stage: str) -> str:
        v = stage_seconds(ctx, stage)
        return f"{v:.0f} s" if v is not None else ""

    tok, tr, ev, ex, exp = s["tokenize"], s["train"], s["evaluate"], s.get("extract"), s["export"]
    nan = float("nan")
    t.add_row("samples (prepared / tokenized)", f"{s['prepare'].samples} / {tok.samples}", secs("prepare"))
    t.add_row("generated replies", f"{s['generate'].samples} conversations", secs("generate"))
    t.add_row("tokens (all / assistant)", f"{tok.tokens} / {tok.assistant_tokens}", secs("tokenize"))
    t.add_row("draft vocabulary", f"{s['vocab'].draft_vocab_size} ids, covers "
              f"{100 * s['vocab'].assistant_token_coverage:.1f}% of assistant tokens", secs("vocab"))
    if ex is not None:
        t.add_row("hidden states", f"{ex.tokens} tokens, layers {ex.layer_ids} ({ex.layer_convention}), "
                  f"{ex.bytes_per_token:.0f} bytes/token", secs("extract"))
    else:
        t.add_row("hidden states", "none stored (train.mode online: the target ran inside training)", "")
    t.add_row("training loss (first -> last)", f"{tr.first_loss if tr.first_loss is not None else nan:.3f} -> "
              f"{tr.loss if tr.loss is not None else nan:.3f} ({tr.steps} steps)", secs("train"))
    t.add_row("TTT accuracy per step", " ".join(f"{a:.2f}" for a in tr.acc), "")
    t.add_row("acceptance length", f"{ev.acceptance_length:.3f} (chain, k={ev.num_draft_tokens}, "
              f"{ev.prompts} held-out prompts, greedy)", secs("evaluate"))
    t.add_row("acceptance rate per position", " ".join(f"{a:.2f}" for a in ev.acceptance_rate_per_position), "")
    if ev.ngram_tokens_per_target_step is not None:
        t.add_row("tokens per target step: drafter vs n-gram lookup",
                  f"{ev.tokens_per_target_step:.3f} vs {ev.ngram_tokens_per_target_step:.3f} (prompt lookup of "
                  f"{ev.num_draft_tokens} tokens, no training, same prompts: the bar training must beat)", "")
    if ev.suffix_tokens_per_target_step is not None:
        t.add_row("tokens per target step: suffix decoding", f"{ev.suffix_tokens_per_target_step:.3f} (vLLM "
                  "'suffix', no training, same prompts)", "")
    if ev.categories_below_ngram_margin is not None:
        t.add_row(f"categories below {ev.ngram_margin:g}x n-gram", ", ".join(ev.categories_below_ngram_margin)
                  or "none", "")
    ties = f"; {ev.lossless_near_ties} parted from it at near-ties" if ev.lossless_near_ties else ""
    lossless = ("not checked" if not ev.lossless_checked else
                f"PASS (equal to the target's greedy output{ties})" if ev.lossless_mismatches == 0
                else f"FAIL ({ev.lossless_mismatches} prompts chose a token the target would not{ties})")
    t.add_row("lossless check", lossless, "")
    t.add_row("exported drafter (SGLang)", exp.folders.get("sglang", "-"), secs("export"))
    if "vllm" in exp.folders:
        t.add_row("exported drafter (vLLM speculators)", exp.folders["vllm"], "")
    if ev.speedup_estimate:
        t.add_row("speedup estimate", f"{ev.speedup_estimate:.2f}x (from timed draft, verify and plain target "
                  "steps)", "")
    out.print(t)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

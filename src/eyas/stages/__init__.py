"""Stage wiring: each stage reads the run folder and the config fields it declares, and writes its own folder.

Every stage module has ``run(ctx) -> summary``, optionally ``preflight(ctx)`` (checks of its inputs' content, run
before anything is written), ``check_config(ctx)`` (checks :func:`run_stages` makes before the first stage of a
whole run, e.g. that evaluate's prompt files exist), ``required_inputs(cfg)`` and ``reads_target_weights(cfg)``
(whether it loads the target's weights with this configuration; absent: it never does), and two declarations:
- ``READS``: the config sections (``"train"``) and fields (``"tokenize.chat_template_kwargs"``) its code reads,
  directly or through the library functions it calls (``tests/e2e/test_fingerprints.py`` runs every stage with a
  config that records what is read and fails on anything undeclared);
- ``INPUTS``: the stages whose outputs it reads.
A stage's fingerprint hashes every section and field of its :func:`dependencies`: its own ``READS`` and, through
``INPUTS``, those of every stage upstream, so a setting that changes an input changes every stage after it.

A stage folder ``RUN/<stage>/`` holds ``fingerprint.json`` and ``fingerprint_values.json`` (the hashes and the
values they hash, written when the stage starts) and ``done.json`` (its typed summary, :mod:`eyas.summaries`,
written atomically when it finishes). A finished stage with the same fingerprint is skipped; a folder made with
another configuration is refused with the differing fields named, unless ``force`` is set, which clears that stage
and every stage that depends on it (its ``INPUTS`` dependents, not every later stage: extract does not depend on
vocab). Partial work inside a stage with a matching fingerprint (generated samples, stored hidden states, training
checkpoints) is resumed.

Before a stage starts, every input it needs (:func:`required_inputs`) must have finished with the configuration
in force: a missing or stale input is refused, naming the input, the changed fields and the command that rebuilds
it; ``force`` redoes only the stage asked for, never a stale input behind it. Nothing is written by a refused
command: the run folder's ``run.json``, ``config.yaml`` and ``environment.json`` are written when a stage starts.

A stage that loads the target's weights first checks that its checkpoint holds every tensor its config requires and
that every file it names is there and readable, from the file headers only (:func:`eyas.targets.weights.check_target`;
a GGUF or llama2.c target as the folder it is converted to); ``eyas run`` checks once before its first stage when any
stage it will run loads them. A stage that reads only the target's config or tokenizer (a served target: generate
through a server, a folder of config and tokenizer files) does not check the weights.

Only the CLI (:mod:`eyas.cli`) imports this package; what stages share lives in library modules.
"""

from __future__ import annotations

import getpass
import platform
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, replace
from functools import cache
from importlib import import_module
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import yaml
from pydantic import BaseModel

from ..config import RunConfig
from ..distributed import process_rank
from ..errors import DiskFullError, EyasError, is_disk_full
from ..families import check_run_servable
from ..io import read_json, stable_hash, write_json_atomic, write_text_atomic
from ..run_folder import STAGES, RunFolder
from ..summaries import SUMMARIES, Summary, read_done, read_summary
from ..targets.load import read_target_config
from ..targets.weights import check_target

# Stages that first refuse a run no engine would serve (extract.layer_ids, vocab.draft_vocab_size, export.formats,
# evaluate.engine against the target: eyas.families.check_run_servable); a check, not an input of their outputs.
SERVABILITY_CHECKED = ("prepare", "vocab", "extract", "export", "evaluate")
# Fields that do not change a stage's output (where it runs, how often it logs) are left out of fingerprints.
# Dotted names reach into nested sections (the server address and how hard to push it do not change replies).
_NEUTRAL = {
    "target": {"device", "cache_dir"}, "train": {"device", "log_every", "loader_workers"},
    "extract": {"ignore_disk_space"}, "tokenize": {"workers"},
    "generate": {"openai.base_url", "openai.api_key_env", "openai.concurrency", "openai.timeout_s",
                 "openai.max_retries", "reuse_from"},  # reuse_from: only runs whose replies are the same are read
}

# Fields added after run folders were made with their sections: left out of a fingerprint while at this value (the
# behaviour before the field existed), so a store or a training run made before is still current. A field set to
# anything else is hashed, and changes the fingerprint as any other.
# Dotted names reach into nested sections, as in _NEUTRAL.
_OMITTED_AT = {"train": {"fp8": "off", "init_vocab": "drafter", "fp8_lm_head": False, "draft.num_hidden_layers": None},
               "extract": {"labels": "hidden", "label_topk": 32, "label_mass": 0.99},
               "prepare": {"self_prompts.system_prompts": None}}


@cache
def stage_module(stage: str) -> ModuleType:
    """The module ``eyas.stages.<stage>``; raises :class:`EyasError` for an unknown stage."""
    if stage not in STAGES:
        raise EyasError(f"unknown stage '{stage}' (stages: {', '.join(STAGES)})")
    return import_module(f"eyas.stages.{stage}")


@cache
def dependencies(stage: str) -> tuple[str, ...]:
    """The config sections and dotted fields whose values make ``stage``'s output: its own ``READS`` and those of
    every stage upstream of it (``INPUTS``, transitively). A field inside a listed section is left out (covered)."""
    mod = stage_module(stage)
    items = set(mod.READS)
    for up in mod.INPUTS:
        items |= set(dependencies(up))
    return tuple(sorted(i for i in items if "." not in i or i.split(".")[0] not in items))


def _jsonable(v: Any) -> Any:
    if isinstance(v, BaseModel):
        return v.model_dump(mode="json")
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


def _value(cfg: RunConfig, dotted: str) -> Any:
    """A section (without its neutral fields) or a dotted field of ``cfg``, as JSON data."""
    section, *rest = dotted.split(".")
    node = getattr(cfg, section)
    for name in rest:
        node = getattr(node, name)
    d = _jsonable(node)
    if not rest:
        for k in _NEUTRAL.get(section, ()):
            *parents, leaf = k.split(".")
            n = d
            for p in parents:
                n = n.get(p) if isinstance(n, dict) else None
            if isinstance(n, dict):
                n.pop(leaf, None)
        for k, at in _OMITTED_AT.get(section, {}).items():
            *parents, leaf = k.split(".")
            n = d
            for p in parents:
                n = n.get(p) if isinstance(n, dict) else None
            if isinstance(n, dict) and leaf in n and n[leaf] == at:
                n.pop(leaf)
    return d


def stage_fingerprint(cfg: RunConfig, stage: str) -> dict:
    """``{section or field: hash}`` of every dependency of ``stage`` (:func:`dependencies`)."""
    return {d: stable_hash(_value(cfg, d)) for d in dependencies(stage)}


@dataclass
class RunContext:
    """What every stage receives: the config, the command's flags and, while a stage runs, its fingerprint.

    ``force``: a stage whose folder was made with another configuration is cleared (with every later stage) and
    redone, instead of refused. ``redo``: stages that ``force`` redoes even when their configuration is unchanged
    (a single-stage command names its stage here). ``fingerprint``: set by :func:`run_stage` for the stage it runs
    (training stores it in its checkpoints). ``argv``: the command line recorded in ``environment.json``.
    """

    cfg: RunConfig
    force: bool = False
    log: Callable[[str], None] = print
    redo: frozenset[str] = frozenset()
    fingerprint: dict | None = None
    argv: list[str] | None = None

    @property
    def run(self) -> RunFolder:
        """The run folder (``cfg.run_dir``) with a path per artifact."""
        return RunFolder(Path(self.cfg.run_dir))


def _git_commit() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except Exception:
        return None


def init_run_dir(ctx: RunContext, argv: list[str] | None = None) -> None:
    """Create the run directory and describe it: run id (once), resolved config, versions, commit, command line."""
    run = ctx.run
    run.root.mkdir(parents=True, exist_ok=True)
    if not run.run_json.exists():
        write_json_atomic(run.run_json, {"run_id": uuid.uuid4().hex, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    import torch
    import transformers

    from .. import __version__

    write_text_atomic(run.config_yaml, yaml.safe_dump(ctx.cfg.model_dump(mode="json"), sort_keys=False))
    write_json_atomic(
        run.environment_json,
        {
            "eyas": __version__, "git_commit": _git_commit(), "python": sys.version.split()[0],
            "torch": torch.__version__, "transformers": transformers.__version__,
            "platform": platform.platform(), "user": getpass.getuser(),
            "argv": argv if argv is not None else sys.argv,
        },
    )


def fingerprint_values(cfg: RunConfig, stage: str) -> dict:
    """``{section or field: value}``: what :func:`stage_fingerprint` hashes, kept beside it to name changes."""
    return {d: _value(cfg, d) for d in dependencies(stage)}


def diff_values(old, new, path: str, out: list[str]) -> None:
    """Append to ``out`` one ``path.key: old -> new`` line per leaf where ``old`` and ``new`` (JSON data) differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        for k in sorted(set(old) | set(new)):
            diff_values(old.get(k), new.get(k), f"{path}.{k}", out)
    elif old != new:
        out.append(f"{path}: {old!r} -> {new!r}")


def changed_fields(run: RunFolder, stage: str, fp: dict, cfg: RunConfig) -> list[str]:
    """The configuration fields whose values differ between ``stage``'s folder and ``cfg`` (``section.field: old ->
    new``); the changed sections' names when the folder predates ``fingerprint_values.json``."""
    old_fp = read_json(run.fingerprint(stage)) if run.fingerprint(stage).exists() else {}
    keys = sorted(k for k in set(old_fp) | set(fp) if old_fp.get(k) != fp.get(k))
    vfile = run.fingerprint_values(stage)
    if not vfile.exists():
        return keys
    old, new, out = read_json(vfile), fingerprint_values(cfg, stage), []
    for k in keys:
        diff_values(old.get(k), new.get(k), k, out)
    return out or keys


def required_inputs(stage: str, cfg: RunConfig) -> tuple[str, ...]:
    """The stages whose outputs ``stage`` reads with this configuration (a module's ``required_inputs(cfg)`` where
    it depends on the configuration, e.g. online training reads no store; else its ``INPUTS``)."""
    mod = stage_module(stage)
    pick = getattr(mod, "required_inputs", None)
    return tuple(pick(cfg)) if pick else tuple(mod.INPUTS)


def reads_target_weights(stage: str, cfg: RunConfig) -> bool:
    """Whether ``stage`` loads the target's weights with this configuration (its module's
    ``reads_target_weights(cfg)``; a module without one reads only the target's config and tokenizer)."""
    pick = getattr(stage_module(stage), "reads_target_weights", None)
    return bool(pick(cfg)) if pick else False


def check_inputs(ctx: RunContext, stage: str) -> None:
    """Refuse to start ``stage`` unless every input it reads finished with the configuration in force: an input
    that has not finished, or whose folder was made with other settings (fields named), is an
    :class:`EyasError` naming the command that rebuilds it."""
    run = ctx.run
    for up in required_inputs(stage, ctx.cfg):
        if not run.done(up).exists():
            raise EyasError(f"{stage} needs '{up}', which has not finished in {run.root}: run `eyas {up} CONFIG` "
                            f"first (or `eyas run CONFIG`)")
        fp = stage_fingerprint(ctx.cfg, up)
        if not run.fingerprint(up).exists() or read_json(run.fingerprint(up)) != fp:
            changes = changed_fields(run, up, fp, ctx.cfg)
            raise EyasError(f"{stage} reads {run.stage(up)}, which was made with another configuration "
                            f"({'; '.join(changes) or 'no fingerprint'}): {rebuild_advice(ctx, up, changes)}")


# Settings a later stage can apply itself, so an earlier stage need not be redone for them
_CHEAPER = {"tokenize.max_length": "or keep the samples and set train.max_length instead (training cuts each "
                                   "sample to it) with tokenize.max_length as it was"}


def rebuild_advice(ctx: RunContext, up: str, changes: list[str]) -> str:
    """The cheapest command that makes ``up`` current again, and what it redoes: the earliest stale stage that ``up``
    depends on (a stage upstream may read the changed field too, e.g. generate reads tokenize.max_length, and then
    ``eyas up --force`` would be refused in turn) and the stages depending on it; plus a cheaper route where a
    later stage can take the change itself (:data:`_CHEAPER`)."""
    chain = [s for s in STAGES if s in _upstream(up) or s == up]
    stale = [s for s in chain if not is_current(ctx, s, stage_fingerprint(ctx.cfg, s)) and ctx.run.stage(s).exists()]
    first = stale[0] if stale else up
    redone = [s for s in dependents(first) if ctx.run.stage(s).exists()]
    if first == up:
        advice = (f"rebuild it first with `eyas {up} CONFIG --force` (it redoes {', '.join(redone)}), or `eyas run "
                  f"CONFIG --force`")
    else:
        advice = (f"{first} reads that setting too, so rebuild from there: `eyas run CONFIG --force` redoes "
                  f"{len(redone)} stages ({', '.join(redone)}) and keeps the others")
    extra = [hint for field, hint in _CHEAPER.items() if any(c.startswith(field + ":") for c in changes)]
    return advice + ("; " + "; ".join(extra) if extra else "")


@cache
def _upstream(stage: str) -> frozenset[str]:
    """Every stage whose outputs ``stage`` reads, directly or through its inputs."""
    out: set[str] = set()
    for up in stage_module(stage).INPUTS:
        out |= {up} | _upstream(up)
    return frozenset(out)


def _check_fingerprint(ctx: RunContext, stage: str, fp: dict) -> bool:
    """True when ``stage`` is already done with this configuration. Handles ``force`` and mismatches."""
    run = ctx.run
    fp_file = run.fingerprint(stage)
    if fp_file.exists():
        old = read_json(fp_file)
        if old != fp:
            if not ctx.force:
                changes = changed_fields(run, stage, fp, ctx.cfg)
                raise EyasError(
                    f"{run.stage(stage)} was made with a different configuration ({'; '.join(changes)}). Use "
                    f"another run_dir, or pass --force to redo '{stage}' and the stages that depend on it."
                )
            clear_from(ctx, stage)
        elif ctx.force and stage in ctx.redo:
            clear_from(ctx, stage)
    return run.done(stage).exists() and fp_file.exists()


def dependents(stage: str) -> list[str]:
    """``stage`` and every stage whose inputs lead back to it (in pipeline order)."""
    out = [stage]
    for s in STAGES[STAGES.index(stage) + 1:]:
        if any(up in out for up in stage_module(s).INPUTS):
            out.append(s)
    return out


def clear_from(ctx: RunContext, stage: str) -> None:
    """Delete ``stage``'s folder and those of the stages that depend on it (:func:`dependents`)."""
    for s in dependents(stage):
        d = ctx.run.stage(s)
        if d.exists():
            ctx.log(f"[eyas] --force: removing {d}")
            shutil.rmtree(d)


def is_current(ctx: RunContext, stage: str, fp: dict) -> bool:
    """True when ``stage`` finished with the configuration whose fingerprint is ``fp`` and is not to be redone
    (``--force`` on it): :func:`run_stage` skips it."""
    fp_file = ctx.run.fingerprint(stage)
    return (fp_file.exists() and read_json(fp_file) == fp and ctx.run.done(stage).exists()
            and not (ctx.force and stage in ctx.redo))


def run_stage(ctx: RunContext, stage: str) -> Summary:
    """Run one stage unless it is already done with this configuration; return its summary.

    Under torchrun every process runs the stage; process 0 writes ``done.json``."""
    module = stage_module(stage)
    fp = stage_fingerprint(ctx.cfg, stage)
    fp_file = ctx.run.fingerprint(stage)
    if is_current(ctx, stage, fp):
        ctx.log(f"[eyas] {stage}: already done in {ctx.run.stage(stage)} (same configuration), skipped")
        return read_summary(ctx.run, stage)
    # refusals first, so that a refused command writes (and deletes) nothing
    check_inputs(ctx, stage)
    if stage in SERVABILITY_CHECKED:   # what no engine serves is refused before the stage does any work
        check_run_servable(ctx.cfg, read_target_config(ctx.cfg.target), ctx.log)
    if reads_target_weights(stage, ctx.cfg):   # headers only: a missing tensor or shard before the weights load
        check_target(ctx.cfg.target, f"{stage} loads its weights")
    if hasattr(module, "preflight"):   # the stage's own checks of its inputs' content (train: the store)
        module.preflight(ctx)
    if fp_file.exists() and read_json(fp_file) != fp and not ctx.force:
        _check_fingerprint(ctx, stage, fp)        # raises, naming the changed fields
    try:
        init_run_dir(ctx, ctx.argv)
        _check_fingerprint(ctx, stage, fp)            # --force clears the stage and its dependents here
        ctx.run.stage(stage).mkdir(parents=True, exist_ok=True)
        write_json_atomic(ctx.run.fingerprint_values(stage), fingerprint_values(ctx.cfg, stage))
        write_json_atomic(fp_file, fp)
        ctx.log(f"[eyas] {stage}: starting")
        t0 = time.time()
        summary = SUMMARIES[stage].model_validate(module.run(replace(ctx, fingerprint=fp)))
        seconds = time.time() - t0
        if process_rank() == 0:
            write_json_atomic(ctx.run.done(stage), {"summary": summary.to_json(), "seconds": round(seconds, 2)})
    except Exception as e:
        if is_disk_full(e):
            raise disk_full(ctx, stage, e) from None
        raise
    ctx.log(f"[eyas] {stage}: done in {seconds:.1f} s")
    return summary


def disk_full(ctx: RunContext, stage: str, e: BaseException) -> DiskFullError:
    """A full disk met by a stage's writes, as one error (extract says more itself:
    :func:`eyas.store.extraction.disk_full_error`): what failed, the free space left, and that the same command
    resumes (files are committed whole, finished stages are skipped, committed work is resumed)."""
    from ..plan import human_bytes
    from ..store.space import disk_free

    where, free = disk_free(ctx.run.root)
    what = f"{type(e).__name__}: {getattr(e, 'strerror', None) or e}" + (
        f", writing {e.filename}" if getattr(e, "filename", None) else "")
    return DiskFullError(
        f"{stage}: the disk is full ({what}) while writing the run folder {ctx.run.root}; the disk holding {where} "
        f"has {human_bytes(free)} free. What was committed is kept: free space (or move run_dir) and run the same "
        f"command again; finished stages are skipped and committed work (generated replies, stored hidden states, "
        f"training checkpoints) is resumed.")


def run_stages(ctx: RunContext, stages: list[str]) -> dict[str, Summary]:
    """Run ``stages`` in order (``eyas run``), after every one that will run (not :func:`is_current`) has checked
    its configuration (``check_config``) and, when one of them loads the target's weights, the target's checkpoint
    has been checked, so what would fail at the last stage fails before the first."""
    to_run = [s for s in stages if not is_current(ctx, s, stage_fingerprint(ctx.cfg, s))]
    for stage in to_run:
        module = stage_module(stage)
        if hasattr(module, "check_config"):
            module.check_config(ctx)
    loading = [s for s in to_run if reads_target_weights(s, ctx.cfg)]
    if loading:   # a broken checkpoint is refused before prepare, not at extract
        names = ", ".join(loading[:-1]) + f" and {loading[-1]}" if len(loading) > 1 else loading[0]
        check_target(ctx.cfg.target, f"{names} will load its weights")
    return {s: run_stage(ctx, s) for s in stages}


def stage_seconds(ctx: RunContext, stage: str) -> float | None:
    """Wall time of a finished stage (``done.json``), ``None`` when it has not finished."""
    return read_done(ctx.run, stage)[1] if ctx.run.done(stage).exists() else None

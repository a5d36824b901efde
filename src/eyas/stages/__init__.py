"""Stage wiring: each stage reads the run directory and its own config section, writes its own folder.

A stage folder ``RUN/<stage>/`` holds ``fingerprint.json`` (a hash of every config section the stage depends on,
written when the stage starts) and ``done.json`` (its summary, written atomically when it finishes). A finished
stage with the same fingerprint is skipped; a folder made with another configuration is refused with the
differing sections named, unless ``--force`` is given, which clears that stage and every stage after it.
Partial work inside a stage with a matching fingerprint (generated samples, stored hidden states, training
checkpoints) is resumed.
"""

from __future__ import annotations

import getpass
import json
import platform
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

from ..config import RunConfig
from ..errors import EyasError
from ..io import read_json, stable_hash, write_json_atomic, write_text_atomic

STAGES = ["prepare", "generate", "tokenize", "vocab", "extract", "train", "export", "evaluate"]

# Config sections each stage depends on (its own and everything upstream that changes its output).
_DEPENDS = {
    "prepare": ["prepare", "target"],  # its report counts tokens with the target's tokenizer
    "generate": ["prepare", "generate", "target"],
    "tokenize": ["prepare", "generate", "target", "tokenize"],
    "vocab": ["prepare", "generate", "target", "tokenize", "vocab"],
    "extract": ["prepare", "generate", "target", "tokenize", "extract"],
    "train": ["prepare", "generate", "target", "tokenize", "vocab", "extract", "train"],
    "export": ["prepare", "generate", "target", "tokenize", "vocab", "extract", "train", "export"],
    "evaluate": ["prepare", "generate", "target", "tokenize", "vocab", "extract", "train", "export", "evaluate"],
}
# Fields that do not change a stage's output (where it runs, how often it logs) are left out of fingerprints.
# Dotted names reach into nested sections (the server address and how hard to push it do not change replies).
_NEUTRAL = {
    "target": {"device", "cache_dir"}, "train": {"device", "log_every", "loader_workers"},
    "extract": {"ignore_disk_space"},
    "generate": {"openai.base_url", "openai.api_key_env", "openai.concurrency", "openai.timeout_s",
                 "openai.max_retries"},
}


def section_fingerprint(cfg: RunConfig, section: str) -> dict:
    d = getattr(cfg, section).model_dump(mode="json")
    for k in _NEUTRAL.get(section, ()):
        *parents, leaf = k.split(".")
        node = d
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return d


def stage_fingerprint(cfg: RunConfig, stage: str) -> dict:
    """``{section: hash}`` of every config section ``stage`` depends on."""
    return {s: stable_hash(section_fingerprint(cfg, s)) for s in _DEPENDS[stage]}


@dataclass
class RunContext:
    """What every stage receives: the config, the run directory and the command's flags."""

    cfg: RunConfig
    force: bool = False
    log: Callable[[str], None] = print
    extra: dict = field(default_factory=dict)

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run_dir)

    def stage_dir(self, stage: str) -> Path:
        return self.run_dir / stage

    def done_summary(self, stage: str) -> dict:
        """The summary a finished upstream stage wrote; raises :class:`EyasError` when it has not run."""
        p = self.stage_dir(stage) / "done.json"
        if not p.exists():
            raise EyasError(f"stage '{stage}' has not finished in {self.run_dir}: run `eyas {stage} CONFIG` first")
        return read_json(p)["summary"]

    def run_id(self) -> str:
        return read_json(self.run_dir / "run.json")["run_id"]


def _git_commit() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except Exception:
        return None


def init_run_dir(ctx: RunContext, argv: list[str] | None = None) -> None:
    """Create the run directory and describe it: run id (once), resolved config, versions, commit, command line."""
    ctx.run_dir.mkdir(parents=True, exist_ok=True)
    run_json = ctx.run_dir / "run.json"
    if not run_json.exists():
        write_json_atomic(run_json, {"run_id": uuid.uuid4().hex, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    import torch
    import transformers

    from .. import __version__

    write_text_atomic(ctx.run_dir / "config.yaml", yaml.safe_dump(ctx.cfg.model_dump(mode="json"), sort_keys=False))
    write_json_atomic(
        ctx.run_dir / "environment.json",
        {
            "eyas": __version__, "git_commit": _git_commit(), "python": sys.version.split()[0],
            "torch": torch.__version__, "transformers": transformers.__version__,
            "platform": platform.platform(), "user": getpass.getuser(),
            "argv": argv if argv is not None else sys.argv,
        },
    )


def _check_fingerprint(ctx: RunContext, stage: str) -> bool:
    """True when ``stage`` is already done with this configuration. Handles --force and mismatches."""
    sdir = ctx.stage_dir(stage)
    fp = stage_fingerprint(ctx.cfg, stage)
    fp_file = sdir / "fingerprint.json"
    if fp_file.exists():
        old = read_json(fp_file)
        if old != fp:
            if not ctx.force:
                changed = sorted(k for k in set(old) | set(fp) if old.get(k) != fp.get(k))
                raise EyasError(
                    f"{sdir} was made with a different configuration (changed sections: {', '.join(changed)}). "
                    f"Use another run_dir, or pass --force to redo '{stage}' and every stage after it."
                )
            clear_from(ctx, stage)
        elif ctx.force and stage in ctx.extra.get("force_stages", ()):
            clear_from(ctx, stage)
    if (sdir / "done.json").exists() and (sdir / "fingerprint.json").exists():
        return True
    sdir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(fp_file, fp)
    return False


def clear_from(ctx: RunContext, stage: str) -> None:
    """Delete ``stage``'s folder and those of every later stage."""
    for s in STAGES[STAGES.index(stage):]:
        d = ctx.stage_dir(s)
        if d.exists():
            ctx.log(f"[eyas] --force: removing {d}")
            shutil.rmtree(d)


def run_stage(ctx: RunContext, stage: str) -> dict:
    """Run one stage unless it is already done with this configuration; return its summary."""
    from importlib import import_module

    if stage not in STAGES:
        raise EyasError(f"unknown stage '{stage}' (stages: {', '.join(STAGES)})")
    if _check_fingerprint(ctx, stage):
        ctx.log(f"[eyas] {stage}: already done in {ctx.stage_dir(stage)} (same configuration), skipped")
        return read_json(ctx.stage_dir(stage) / "done.json")["summary"]
    ctx.log(f"[eyas] {stage}: starting")
    t0 = time.time()
    module = import_module(f"eyas.stages.{stage}")
    summary = module.run(ctx)
    seconds = time.time() - t0
    if ctx.extra.pop("write_done", True):  # False on data-parallel ranks other than 0 (extract)
        write_json_atomic(ctx.stage_dir(stage) / "done.json", {"summary": summary, "seconds": round(seconds, 2)})
    ctx.log(f"[eyas] {stage}: done in {seconds:.1f} s")
    return summary


def stage_seconds(ctx: RunContext, stage: str) -> float | None:
    p = ctx.stage_dir(stage) / "done.json"
    return json.loads(p.read_text()).get("seconds") if p.exists() else None

"""export: convert the trained drafter (``train/final``) into folders engines load as they are (``export/sglang``,
``export/vllm``), by the key table (:mod:`eyas.export.keys`); the target's weights are not loaded.

Each folder gets ``eyas_export.json`` (the aux layers the drafter was trained on, the target, the convention), and is
then re-read by :func:`eyas.export.check.check_folder` with the target's config: an export that an engine would
skip, misread or refuse fails the stage instead of failing silently in production.
"""

from __future__ import annotations

from pathlib import Path

from ..drafter import DrafterConfig, read_drafter
from ..errors import EyasError
from ..export.check import MANIFEST, check_folder
from ..export.sglang import write_sglang
from ..export.vllm import write_vllm
from ..io import read_json, write_json_atomic
from ..summaries import ExportCheck, ExportSummary
from ..targets.load import materialize_target
from . import RunContext

READS = ("export", "target")
INPUTS = ("train",)


def _target_folder(ctx: RunContext, drafter: DrafterConfig) -> Path:
    """The target's Hugging Face folder the drafter was trained for (recorded in its config), without converting
    it again; the configured target's when that folder is gone."""
    recorded = drafter.target.get("path")
    if recorded and (Path(recorded) / "config.json").exists():
        return Path(recorded)
    return materialize_target(ctx.cfg.target)


def run(ctx: RunContext) -> ExportSummary:
    cfg = ctx.cfg.export
    drafter = read_drafter(ctx.run.drafter)
    dcfg = drafter.config
    target_dir = _target_folder(ctx, dcfg)
    target_cfg = read_json(target_dir / "config.json")
    out, checks = {}, {}
    for fmt in cfg.formats:
        d = ctx.run.export(fmt)
        if fmt == "sglang":
            write_sglang(d, drafter, target_cfg)
        else:
            write_vllm(d, drafter, target_cfg, verifier=cfg.verifier or str(target_dir.resolve()),
                       num_speculative_tokens=cfg.num_speculative_tokens)
        write_json_atomic(d / MANIFEST, {"aux_layer_ids": dcfg.aux_layer_ids, "layer_convention": dcfg.layer_convention,
                                         "target": dcfg.target, "format": fmt})
        rep = check_folder(d, target_cfg)
        engines = ("sglang", "vllm") if fmt == "sglang" else ("vllm",)
        errors = [f for e in engines for f in rep.errors(e)]
        if errors:
            raise EyasError(f"export check failed for {d}:\n" + "\n".join(f"  {f}" for f in errors))
        out[fmt] = str(d)
        checks[fmt] = ExportCheck(captured_hf_index=rep.captured,
                                  warnings=[str(f) for f in rep.findings if f.level == "warning"])
        ctx.log(f"[eyas] export: {fmt} folder {d} (checked: {', '.join(engines)})")
    return ExportSummary(folders=out, checks=checks)

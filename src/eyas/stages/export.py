"""export: convert the trained drafter (``train/final``) into folders engines load as they are (``export/sglang``,
``export/vllm``), by the key table (:mod:`eyas.export.keys`); the target's weights are not loaded.

Each folder gets ``eyas_export.json`` (the aux layers the drafter was trained on, the target, the convention), is
written under a temporary name, re-read by :func:`eyas.export.check.check_folder` with the target's config, and moved
into place only when no engine it is meant for would skip, misread or refuse it: a failed export leaves nothing
behind. A drafter trained on aux layers the asked-for engines cannot capture is refused before anything is written.
With ``export.max_shard_bytes`` the weights are split into safetensors files of at most that size.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..drafter import DrafterConfig, read_drafter
from ..errors import EyasError
from ..export.check import MANIFEST, check_folder
from ..export.sglang import write_sglang
from ..export.vllm import write_vllm
from ..families import ENGINES_OF_FORMAT, aux_layer_id_problems, convert_layer_ids, text_config
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
    ids, conv = dcfg.aux_layer_ids, dcfg.layer_convention
    engines_asked = tuple(dict.fromkeys(e for f in cfg.formats for e in ENGINES_OF_FORMAT[f]))
    problems = aux_layer_id_problems(convert_layer_ids(ids, conv, "output_of_layer"),
                                     int(text_config(target_cfg)["num_hidden_layers"]), engines_asked)
    if problems:  # the drafter itself was trained on layers the engines do not capture
        raise EyasError(f"export: the drafter in {ctx.run.drafter} was trained on aux layers {ids} ({conv}), which "
                        f"{' and '.join(engines_asked)} cannot serve: " + "; ".join(problems))
    out, checks = {}, {}
    for fmt in cfg.formats:
        d = ctx.run.export(fmt)
        tmp = d.with_name(f".{fmt}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        if fmt == "sglang":
            write_sglang(tmp, drafter, target_cfg, max_shard_bytes=cfg.max_shard_bytes)
        else:
            write_vllm(tmp, drafter, target_cfg, verifier=cfg.verifier or str(target_dir.resolve()),
                       num_speculative_tokens=cfg.num_speculative_tokens, max_shard_bytes=cfg.max_shard_bytes)
        write_json_atomic(tmp / MANIFEST, {"aux_layer_ids": ids, "layer_convention": conv, "target": dcfg.target,
                                           "format": fmt})
        rep = check_folder(tmp, target_cfg)
        engines = ENGINES_OF_FORMAT[fmt]
        errors = [f for e in engines for f in rep.errors(e)]
        if errors:
            shutil.rmtree(tmp, ignore_errors=True)
            raise EyasError(f"export check failed for {d} (nothing written there):\n"
                            + "\n".join(f"  {f}" for f in errors))
        shutil.rmtree(d, ignore_errors=True)
        tmp.rename(d)
        rep.folder = d
        out[fmt] = str(d)
        checks[fmt] = ExportCheck(captured_hf_index=rep.captured,
                                  warnings=[str(f) for f in rep.findings if f.level == "warning"])
        ctx.log(f"[eyas] export: {fmt} folder {d} (checked: {', '.join(engines)})")
    return ExportSummary(folders=out, checks=checks)

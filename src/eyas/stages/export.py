"""export: write the trained draft as folders engines load as they are (``export/sglang``, ``export/vllm``).

Each folder gets ``eyas_export.json`` (the aux layers the drafter was trained on, the target, the convention), and is
then re-read by :func:`eyas.export.check.check_folder` with the target's config: an export that an engine would
skip, misread or refuse fails the stage instead of failing silently in production. Each folder is written under a
temporary name and moved into place only once it passes, so a rejected folder is never left where an engine (or a
user) would take it for the export.
"""

from __future__ import annotations

import shutil

import torch

from ..errors import EyasError
from ..export.check import MANIFEST, check_folder
from ..export.sglang import write_sglang
from ..export.vllm import write_vllm
from ..families import ENGINES_OF_FORMAT, aux_layer_id_problems, check_run_servable, convert_layer_ids, text_config
from ..io import write_json_atomic
from ..targets.load import materialize_target, read_target_config
from . import RunContext
from .train import load_trained_draft


def run(ctx: RunContext) -> dict:
    cfg = ctx.cfg.export
    target_cfg = read_target_config(ctx.cfg.target)
    check_run_servable(ctx.cfg, target_cfg, ctx.log)   # export.formats may have changed since the run started
    model, meta = load_trained_draft(ctx, torch.device("cpu"))
    ids, conv = meta["aux_layer_ids"], meta["layer_convention"]
    engines_asked = tuple(dict.fromkeys(e for f in cfg.formats for e in ENGINES_OF_FORMAT[f]))
    problems = aux_layer_id_problems(convert_layer_ids(ids, conv, "output_of_layer"),
                                     int(text_config(target_cfg)["num_hidden_layers"]), engines_asked)
    if problems:  # the drafter itself was trained on layers the engines do not capture
        raise EyasError(f"export: the drafter in {ctx.stage_dir('train') / 'final'} was trained on aux layers {ids} "
                        f"({conv}), which {' and '.join(engines_asked)} cannot serve: " + "; ".join(problems))
    out, checks = {}, {}
    for fmt in cfg.formats:
        d = ctx.stage_dir("export") / fmt
        tmp = d.with_name(f".{fmt}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        if fmt == "sglang":
            write_sglang(tmp, model, ids, conv, target_cfg, max_shard_bytes=cfg.max_shard_bytes)
        else:
            verifier = cfg.verifier or str(materialize_target(ctx.cfg.target).resolve())
            write_vllm(tmp, model, ids, conv, target_cfg, verifier=verifier,
                       num_speculative_tokens=cfg.num_speculative_tokens, max_shard_bytes=cfg.max_shard_bytes)
        write_json_atomic(tmp / MANIFEST, {"aux_layer_ids": ids, "layer_convention": conv, "target": meta["target"],
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
        checks[fmt] = {"captured_hf_index": rep.captured, "warnings": [str(f) for f in rep.findings
                                                                       if f.level == "warning"]}
        ctx.log(f"[eyas] export: {fmt} folder {d} (checked: {', '.join(engines)})")
    return {"folders": out, "checks": checks}

"""Checkpoints: the whole training state, written atomically, the last N kept.

A checkpoint folder ``step-{N:08d}`` holds ``draft.safetensors`` (trainable weights + d2t/t2d),
``optimizer.pt`` (the optimizer's state dict: tensors, numbers, tuples; read back with
``torch.load(weights_only=True)``, never unpickling arbitrary objects), and ``state.json`` (step, data position,
scheduler position, fingerprint). It is written to a temporary folder and renamed into place, so a crash leaves
either a whole checkpoint or none.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import EyasError
from ..io import fsync_dir


def save_checkpoint(root: Path, step: int, model_state: dict, optimizer_state: dict, state: dict,
                    keep_last: int) -> Path:
    """Write ``step-{step:08d}`` atomically and delete all but the newest ``keep_last`` checkpoints.

    ``model_state``: the draft's trainable tensors (names as the served checkpoint's); ``optimizer_state``: a
    full optimizer state dict (:meth:`eyas.distributed.Dist.optimizer_state`); ``state``: JSON-able.
    """
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in model_state.items()}, str(tmp / "draft.safetensors"))
        torch.save(optimizer_state, tmp / "optimizer.pt")
        (tmp / "state.json").write_text(json.dumps(state, indent=2) + "\n")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders are ignored)."""
    if not root.exists():
        return []
    return sorted(p for p in root.glob("step-*") if (p / "state.json").exists())


def load_checkpoint(path: Path, device: torch.device) -> tuple[dict, dict, dict]:
    """``(model_state, optimizer_state, state)`` of one checkpoint."""
    try:
        model_state = load_file(str(path / "draft.safetensors"), device=str(device))
        opt_state = torch.load(path / "optimizer.pt", map_location=device, weights_only=True)
        state = json.loads((path / "state.json").read_text())
    except Exception as e:
        raise EyasError(f"{path}: unreadable checkpoint ({e}); delete it to resume from the one before") from e
    return model_state, opt_state, state

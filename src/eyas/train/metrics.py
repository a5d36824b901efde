"""One optimizer step's metrics, typed (a line of ``train/metrics.jsonl``), and the end-of-run summary made from
them. The line keeps flat keys (``loss_0``, ``acc_0``, ``count_0``, ...: TensorBoard tags and wandb keys are the
same names); :class:`StepMetrics` gives them structure.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

_PER_STEP = re.compile(r"(loss|acc|count|eval_acc)_(\d+)$")


@dataclass
class StepMetrics:
    """Metrics of optimizer step ``step`` (1-based). Per TTT step k (lists of length K): ``loss_k`` the
    cross-entropy of step k averaged over its counted positions, ``acc_k`` the fraction of those positions where
    the draft's argmax equals the target's, ``count_k`` the positions counted (global batch). ``loss`` is
    ``sum_k ttt_decay**k * loss_k``. ``lr`` is the step's learning rate; ``grad_norm`` the norm before clipping;
    ``tokens`` real (unpadded) tokens seen so far and ``tokens_per_s`` their rate since the start of this process,
    ``recent_tokens_per_s`` the step's own (its real tokens over the wall time since the previous step);
    ``gpu_max_memory_gb`` the peak allocated GPU memory. ``eval_*``: the held-out evaluation, on the steps it runs."""

    step: int
    loss: float
    loss_k: list[float] = field(default_factory=list)
    acc_k: list[float] = field(default_factory=list)
    count_k: list[int] = field(default_factory=list)
    lr: float | None = None
    grad_norm: float | None = None
    tokens: int | None = None
    tokens_per_s: float | None = None
    recent_tokens_per_s: float | None = None
    gpu_max_memory_gb: float | None = None
    eval_loss: float | None = None
    eval_acc_k: list[float] | None = None

    def to_json(self) -> dict:
        """The flat ``metrics.jsonl`` line: step, loss, then ``loss_k``/``acc_k``/``count_k`` per TTT step, then the
        rest; ``None`` fields are left out."""
        d: dict = {"step": self.step, "loss": self.loss}
        for k, (l_k, a_k, c_k) in enumerate(zip(self.loss_k, self.acc_k, self.count_k)):
            d.update({f"loss_{k}": l_k, f"acc_{k}": a_k, f"count_{k}": c_k})
        for name in ("lr", "grad_norm", "tokens", "tokens_per_s", "recent_tokens_per_s", "gpu_max_memory_gb",
                     "eval_loss"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        for k, a in enumerate(self.eval_acc_k or []):
            d[f"eval_acc_{k}"] = a
        return d

    @classmethod
    def from_json(cls, d: dict) -> "StepMetrics":
        """Parse a ``metrics.jsonl`` line (the per-step keys may be missing: lists stop at the first gap)."""
        lists: dict[str, dict[int, float]] = {"loss": {}, "acc": {}, "count": {}, "eval_acc": {}}
        plain = {}
        for key, v in d.items():
            m = _PER_STEP.match(key)
            if m:
                lists[m.group(1)][int(m.group(2))] = v
            else:
                plain[key] = v

        def seq(name: str) -> list:
            out, k = [], 0
            while k in lists[name]:
                out.append(lists[name][k])
                k += 1
            return out

        return cls(step=int(plain["step"]), loss=float(plain["loss"]), loss_k=seq("loss"), acc_k=seq("acc"),
                   count_k=[int(c) for c in seq("count")], lr=plain.get("lr"), grad_norm=plain.get("grad_norm"),
                   tokens=plain.get("tokens"), tokens_per_s=plain.get("tokens_per_s"),
                   recent_tokens_per_s=plain.get("recent_tokens_per_s"),
                   gpu_max_memory_gb=plain.get("gpu_max_memory_gb"), eval_loss=plain.get("eval_loss"),
                   eval_acc_k=seq("eval_acc") or None)


def read_metrics(path: Path) -> list[StepMetrics]:
    """Every step of a ``metrics.jsonl`` file, in order; ``[]`` when the file does not exist."""
    path = Path(path)
    if not path.exists():
        return []
    return [StepMetrics.from_json(json.loads(x)) for x in path.read_text().splitlines() if x.strip()]


def summarise_metrics(path: Path, ttt_steps: int, last_fraction: float = 0.1) -> dict:
    """Mean loss and per-step accuracy over the last ``last_fraction`` of logged steps (a stable end-of-run view),
    the first step's loss, the last step, and the last held-out evaluation; ``{}`` without logged steps. Keys as
    :class:`~eyas.summaries.TrainSummary` takes them."""
    rows = read_metrics(path)
    if not rows:
        return {}
    tail = rows[-max(1, int(len(rows) * last_fraction)):]
    out: dict = {"loss": sum(r.loss for r in tail) / len(tail), "first_loss": rows[0].loss, "steps": rows[-1].step,
                 "acc": [sum(r.acc_k[k] if k < len(r.acc_k) else 0.0 for r in tail) / len(tail)
                         for k in range(ttt_steps)]}
    evals = [r for r in rows if r.eval_loss is not None]
    if evals:
        out["eval_loss"] = evals[-1].eval_loss
        out["eval_acc"] = [evals[-1].eval_acc_k[k] for k in range(ttt_steps)]
    return out

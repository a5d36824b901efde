"""The summary each stage returns and writes to ``RUN/<stage>/done.json`` (``{"summary": ..., "seconds": ...}``),
typed: the CLI's end-of-run table, ``eyas report`` and the tests read fields, not string keys.

``done.json`` holds exactly the fields a stage set (:meth:`Summary.to_json`), so a field a stage leaves out (e.g.
``finish_length`` when generation is off) is absent there, not ``null``.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, model_serializer, model_validator

from .errors import EyasError
from .io import read_json
from .run_folder import RunFolder


class Summary(BaseModel):
    """Base of the stage summaries: unknown fields are errors."""

    model_config = ConfigDict(extra="forbid")

    def to_json(self) -> dict:
        """The summary as ``done.json`` holds it: the fields that were set."""
        return self.model_dump(mode="json", exclude_unset=True)


class PrepareSummary(Summary):
    samples: int
    duplicates: int
    skipped: int
    tokens: int  # tokens of the turn texts, chat template excluded (prepare/report.json says how counted)


class GenerateSummary(Summary):
    samples: int
    regenerated: bool               # false: the dataset's own assistant turns were kept
    finish_length: int | None = None  # replies cut at generate.max_new_tokens (this run)
    skipped: int | None = None
    new_tokens_per_s: float | None = None  # the in-process engine's, this run


class TokenizeSummary(Summary):
    samples: int
    tokens: int
    assistant_tokens: int
    truncated: int
    skipped: int
    replies_whitespace_changed: int | None = None  # replies kept whose outer whitespace the template changed
    replies_trained_as_emitted: int | None = None  # replies whose emitted ids replaced their text's tokens
    turns_cut_at_limit: int | None = None  # replies cut at the token limit: no end-of-turn token trained


class VocabSummary(Summary):
    """Also written as ``vocab/vocab.json``."""

    draft_vocab_size: int
    target_vocab_size: int
    distinct_assistant_tokens: int
    assistant_tokens: int
    assistant_token_coverage: float  # fraction of assistant tokens inside the draft vocabulary
    coverage_by_size: dict[str, float] | None = None  # draft vocabulary size -> fraction it would cover


class ExtractSummary(Summary):
    samples: int
    tokens: int
    layer_ids: list[int]
    layer_convention: str
    dtype: str
    aux_format: str
    store_bytes: int
    bytes_per_token: float
    tokens_per_s: float | None  # of this run's extraction (None when nothing was left to extract)
    ranks: int
    labels: str = "hidden"      # extract.labels: the last hidden state, or top-k labels (label_topk ids a token)
    label_topk: int | None = None
    label_mass_by_k: dict[int, float] | None = None   # measured: mean draft-vocabulary mass the top k ids hold


_ACC = re.compile(r"(eval_)?acc_(\d+)$")


class TrainSummary(Summary):
    """Loss and accuracies are means over the last 10% of logged steps (:func:`eyas.train.metrics.summarise_metrics`);
    ``eval_*`` from the last held-out evaluation. In ``done.json`` the per-step lists are written as
    ``acc_0 .. acc_{K-1}`` and ``eval_acc_0 ..`` (the keys of ``train/metrics.jsonl``)."""

    loss: float | None = None
    first_loss: float | None = None
    steps: int
    acc: list[float] = []           # per TTT step
    eval_loss: float | None = None
    eval_acc: list[float] | None = None
    trainable_parameters: int
    mode: str
    tokens_per_s: float
    stopped_early: bool | None = None   # the held-out stop rule ended the run (train.stop_after_no_gain)
    stopped_on_request: bool | None = None  # RUN/train/STOP ended the run before its schedule did
    fp8: str = "off"                # the fp8 scaling the draft's matrix products used (train.fp8; "off": none)
    fp8_fallback: str | None = None  # why train.fp8 was asked for but not used (the device, its GPU, no torchao)
    fp8_lm_head: bool = False       # the draft lm_head's products in fp8 inside the fused loss (train.fp8_lm_head)

    @model_validator(mode="before")
    @classmethod
    def _lists_from_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not any(_ACC.match(k) for k in data):
            return data
        out, lists = {}, {"acc": {}, "eval_acc": {}}
        for k, v in data.items():
            m = _ACC.match(k)
            if m:
                lists["eval_acc" if m.group(1) else "acc"][int(m.group(2))] = v
            else:
                out[k] = v
        for name, vals in lists.items():
            if vals:
                out[name] = [vals[i] for i in range(len(vals))]
        return out

    @model_serializer(mode="wrap")
    def _keys_from_lists(self, handler) -> dict:
        out = {}
        for k, v in handler(self).items():   # the lists' keys in place of the list, field order kept
            if k in ("acc", "eval_acc") and isinstance(v, list):
                out.update({f"{k}_{i}": x for i, x in enumerate(v)})
            else:
                out[k] = v
        return out


class ExportCheck(Summary):
    captured_hf_index: dict[str, list[int] | None]  # engine -> the hf_index layers it would capture
    warnings: list[str]


class ExportSummary(Summary):
    folders: dict[str, str]         # format -> folder
    checks: dict[str, ExportCheck]


class SetSummary(Summary):
    """Acceptance on one prompt set. A round is one target verification; ``acceptance_length`` =
    (rounds + accepted drafts) / rounds (the target's bonus token counted)."""

    rounds: int
    accepted: int
    accepted_per_pos: list[int]
    acceptance_length: float
    acceptance_rate_per_position: list[float]
    prompts: int
    turns: int
    lossless_mismatches: int | None              # prompts whose check failed (eyas.evaluate.decoder.check_greedy)
    lossless_near_ties: int | None = None        # prompts that parted from the target's output only at a near-tie
    lossless_passed: int | None = None           # prompts token for token equal to the target's output
    draft_seconds_per_round: float | None = None
    verify_seconds_per_round: float | None = None
    target_step_seconds: float | None = None
    speedup_estimate: float | None = None
    vllm_seconds: float | None = None
    tokens_per_target_step: float | None = None  # new tokens per target forward over every verify step
    generated: int | None = None                 # vLLM: new tokens of the set
    method: str | None = None                    # the baseline's drafting method
    ngram: SetSummary | None = None              # prompt-lookup drafting on the same prompts (evaluate.baseline)
    same_output_as_ngram: bool | None = None
    gain_over_ngram: float | None = None         # tokens_per_target_step / ngram's
    suffix: SetSummary | None = None             # suffix decoding on the same prompts (vLLM 'suffix', arctic-inference)
    same_output_as_suffix: bool | None = None
    gain_over_suffix: float | None = None
    categories: dict[str, SetSummary] | None = None  # per category of the rows (evaluate.category_field)


class EvaluateSummary(Summary):
    """The overall figures over every set, and each set's (``evaluate/results.json`` adds per-prompt rows)."""

    engine: str
    draft_folder: str
    prompts: int
    num_draft_tokens: int
    topk: int
    temperature: float
    acceptance_length: float
    acceptance_rate_per_position: list[float]
    rounds: int
    lossless_checked: bool
    lossless_mismatches: int | None
    lossless_near_ties: int | None = None
    speedup_estimate: float | None = None
    tokens_per_target_step: float | None = None        # the drafter's, all sets
    ngram_tokens_per_target_step: float | None = None  # prompt-lookup drafting's on the same prompts
    suffix_tokens_per_target_step: float | None = None  # suffix decoding's (evaluate.baseline 'suffix', vLLM)
    ngram_margin: float | None = None                  # evaluate.ngram_margin, when categories were measured
    categories_below_ngram_margin: list[str] | None = None  # "set/category" whose gain_over_ngram < margin, worst first
    sets: dict[str, SetSummary]


SUMMARIES: dict[str, type[Summary]] = {
    "prepare": PrepareSummary, "generate": GenerateSummary, "tokenize": TokenizeSummary, "vocab": VocabSummary,
    "extract": ExtractSummary, "train": TrainSummary, "export": ExportSummary, "evaluate": EvaluateSummary,
}


def read_done(run: RunFolder, stage: str) -> tuple[Summary, float | None]:
    """``(summary, seconds)`` a finished stage wrote; raises :class:`EyasError` when it has not finished."""
    p = run.done(stage)
    if not p.exists():
        raise EyasError(f"stage '{stage}' has not finished in {run.root}: run `eyas {stage} CONFIG` first")
    d = read_json(p)
    return SUMMARIES[stage].model_validate(d["summary"]), d.get("seconds")


def read_summary(run: RunFolder, stage: str) -> Summary:
    """The summary a finished stage wrote (see :func:`read_done`)."""
    return read_done(run, stage)[0]

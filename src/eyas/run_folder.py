"""The run folder (the config's ``run_dir``): one typed object with a path per artifact, so that no module spells
an artifact's path itself. Layout::

    run.json  config.yaml  environment.json    the run's id (made once), resolved config, versions and command line
    writer.lock                                while a command writes the run: who (eyas.run_lock)
    <stage>/fingerprint.json  <stage>/done.json   per stage: the config it was made with, its summary when finished
    prepare/conversations.jsonl  report.json  token_lengths.png
    generate/conversations.jsonl  report.json
    tokenize/samples.jsonl  meta.json
    vocab/vocab.safetensors  vocab.json
    extract/store/                             the hidden-state store (eyas.store.shards)
    train/checkpoints/  metrics.jsonl  tensorboard/  final/   final/ is a drafter folder (eyas.drafter)
    export/sglang/  export/vllm/               folders the engines load as they are
    evaluate/results.json
    report/                                    `eyas report`: the HTML page and its figures

``train/checkpoints``, ``metrics.jsonl`` and ``tensorboard`` are written by :func:`eyas.train.loop.train` into the
folder it is given (``train/``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .io import read_json

#: the stages in pipeline order; a stage's folder is ``RUN/<stage>``
STAGES = ["prepare", "generate", "tokenize", "vocab", "extract", "train", "export", "evaluate"]


@dataclass(frozen=True)
class RunFolder:
    """Paths of one run's artifacts. Creating the object touches no file."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    # ------------------------------------------------------------------ the run itself
    @property
    def run_json(self) -> Path:
        return self.root / "run.json"

    @property
    def config_yaml(self) -> Path:
        return self.root / "config.yaml"

    @property
    def environment_json(self) -> Path:
        return self.root / "environment.json"

    @property
    def writer_lock(self) -> Path:
        """Held (``flock``) by the one command writing this run folder, naming it (:mod:`eyas.run_lock`); present
        only while a command runs, or after one was killed (then the next command takes it over)."""
        return self.root / "writer.lock"

    def is_run(self) -> bool:
        """True when the folder has been initialised as a run (``run.json`` exists)."""
        return self.run_json.exists()

    def run_id(self) -> str:
        """The run's id, made once when the folder was initialised (``run.json``)."""
        return read_json(self.run_json)["run_id"]

    # ------------------------------------------------------------------ per stage
    def stage(self, name: str) -> Path:
        """``RUN/<stage>``."""
        return self.root / name

    def fingerprint(self, stage: str) -> Path:
        return self.stage(stage) / "fingerprint.json"

    def fingerprint_values(self, stage: str) -> Path:
        """``RUN/<stage>/fingerprint_values.json``: the values the fingerprint hashes, so a change is named by field."""
        return self.stage(stage) / "fingerprint_values.json"

    def done(self, stage: str) -> Path:
        return self.stage(stage) / "done.json"

    # ------------------------------------------------------------------ artifacts
    @property
    def prepared(self) -> Path:
        """prepare's conversations (:class:`~eyas.records.Conversation` per line)."""
        return self.stage("prepare") / "conversations.jsonl"

    @property
    def prepare_report(self) -> Path:
        return self.stage("prepare") / "report.json"

    @property
    def token_lengths_png(self) -> Path:
        return self.stage("prepare") / "token_lengths.png"

    @property
    def generated(self) -> Path:
        """generate's conversations, with the target's own replies."""
        return self.stage("generate") / "conversations.jsonl"

    @property
    def generate_report(self) -> Path:
        return self.stage("generate") / "report.json"

    @property
    def tokenized(self) -> Path:
        """tokenize's samples (:class:`~eyas.records.TokenizedSample` per line)."""
        return self.stage("tokenize") / "samples.jsonl"

    @property
    def tokenize_meta(self) -> Path:
        """Tokenizer identity, chat-template hash, token counts, truncations and skips."""
        return self.stage("tokenize") / "meta.json"

    @property
    def vocab(self) -> Path:
        """``d2t`` and ``t2d`` of the draft vocabulary (:mod:`eyas.data.vocab`)."""
        return self.stage("vocab") / "vocab.safetensors"

    @property
    def vocab_info(self) -> Path:
        return self.stage("vocab") / "vocab.json"

    @property
    def store(self) -> Path:
        """The hidden-state store folder."""
        return self.stage("extract") / "store"

    @property
    def train_metrics(self) -> Path:
        """One JSON line per optimizer step (:class:`~eyas.train.metrics.StepMetrics`)."""
        return self.stage("train") / "metrics.jsonl"

    @property
    def train_stop(self) -> Path:
        """Touched by a user to end training early: the loop checkpoints and writes ``train/final``."""
        return self.stage("train") / "STOP"

    @property
    def drafter(self) -> Path:
        """The trained drafter folder (:mod:`eyas.drafter`), from which export builds the engine folders."""
        return self.stage("train") / "final"

    def export(self, fmt: str) -> Path:
        """The exported folder of one engine format (``sglang``, ``vllm``)."""
        return self.stage("export") / fmt

    @property
    def evaluation(self) -> Path:
        """evaluate's results: per set and overall, per prompt for the reference decoder."""
        return self.stage("evaluate") / "results.json"

    @property
    def report(self) -> Path:
        """Default folder of ``eyas report``."""
        return self.root / "report"

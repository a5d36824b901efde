"""Typed records that cross stage boundaries, and their on-disk (JSONL) form.

- :class:`Conversation`: prepare -> generate -> tokenize. Normalised roles ``system|user|assistant``.
- :class:`TokenizedSample`: tokenize -> vocab, extract, train. ``input_ids`` and ``loss_mask`` have equal length T.
- :class:`SkipRecord`: a dropped row or turn, with file, line and reason; every stage reports them.

Sample ids are stable: a hash of the normalised content (roles and texts of the user/system turns, plus assistant
turns as read from the source, with their reasoning where they carry one), so a re-run of prepare on the same data
gives the same ids and de-duplicates.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from .io import iter_jsonl, stable_hash

Role = Literal["system", "user", "assistant"]
FinishReason = Literal["stop", "length"]


@dataclass
class Message:
    """One turn. ``reasoning_content``: an assistant reply's reasoning, apart from its answer (``content``), as a
    dataset row (``reasoning_content`` or ``reasoning``) or a server with a reasoning parser gives it; the chat
    template decides where it is rendered (Qwen3: a ``<think>`` block, for turns after the last user turn).
    ``token_ids``: a regenerated reply's exact token ids as the target emitted them (without the
    end-of-turn token), kept beside its text so later stages can check that the text renders back to them.

    How an assistant reply ended, where known: ``finish_reason`` is ``"stop"`` (the target ended it; ``stop_token``
    the id it ended on, when the backend says) or ``"length"`` (cut at ``generate.max_new_tokens`` or the source's
    token limit: the target never emitted an end-of-turn token there, so tokenize does not train one). ``None``:
    unknown (a source that does not say, a run folder written before Eyas kept it): trained as a finished reply."""

    role: Role
    content: str
    reasoning_content: str | None = None
    token_ids: list[int] | None = None
    finish_reason: FinishReason | None = None
    stop_token: int | None = None

    def to_dict(self) -> dict:
        """The chat-template form (role, content, reasoning)."""
        d = {"role": self.role, "content": self.content}
        if self.reasoning_content:
            d["reasoning_content"] = self.reasoning_content
        return d

    def to_json(self) -> dict:
        """The on-disk form: :meth:`to_dict` plus ``token_ids``, ``finish_reason`` and ``stop_token`` when known
        (absent when unknown, so files written before these fields existed read back the same)."""
        d = self.to_dict()
        if self.token_ids is not None:
            d["token_ids"] = self.token_ids
        if self.finish_reason is not None:
            d["finish_reason"] = self.finish_reason
        if self.stop_token is not None:
            d["stop_token"] = self.stop_token
        return d


@dataclass
class Conversation:
    """A normalised conversation. ``source`` is ``file:line`` of the row it came from."""

    id: str
    messages: list[Message]
    source: str = ""

    @staticmethod
    def make_id(messages: list[Message]) -> str:
        """The sample id: a hash of roles and texts, and of a turn's reasoning where it has one (so the same answer
        with other reasoning is another sample, and ids of conversations without reasoning are as before)."""
        return stable_hash([[m.role, m.content] + ([m.reasoning_content] if m.reasoning_content else [])
                            for m in messages], n=16)

    def to_json(self) -> dict:
        return {"id": self.id, "source": self.source, "messages": [m.to_json() for m in self.messages]}

    @classmethod
    def from_json(cls, d: dict) -> "Conversation":
        return cls(id=d["id"], source=d.get("source", ""), messages=[Message(**m) for m in d["messages"]])

    def chat_messages(self) -> list[dict]:
        return [m.to_dict() for m in self.messages]


@dataclass
class TokenizedSample:
    """One training sequence. ``input_ids``: [T] target token ids; ``loss_mask``: [T] 0/1, 1 on assistant tokens."""

    id: str
    input_ids: list[int]
    loss_mask: list[int]

    def __post_init__(self) -> None:
        assert len(self.input_ids) == len(self.loss_mask), "input_ids and loss_mask differ in length"

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "TokenizedSample":
        return cls(id=d["id"], input_ids=d["input_ids"], loss_mask=d["loss_mask"])


@dataclass
class SkipRecord:
    """Something dropped, and why: ``where`` is ``file:line`` (or a sample id), ``field`` the field at fault."""

    where: str
    reason: str
    field: str = ""

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class SkipCounter:
    """Counts skips by reason and keeps the first ``keep`` examples of each for the report."""

    keep: int = 20
    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[dict]] = field(default_factory=dict)

    def add(self, rec: SkipRecord) -> None:
        self.counts[rec.reason] = self.counts.get(rec.reason, 0) + 1
        ex = self.examples.setdefault(rec.reason, [])
        if len(ex) < self.keep:
            ex.append(rec.to_json())

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def to_json(self) -> dict:
        return {"total": self.total, "by_reason": dict(sorted(self.counts.items())), "examples": self.examples}


def read_conversations(path: Path) -> list[Conversation]:
    """Every :class:`Conversation` of a JSONL file, in file order (prepare's and generate's output)."""
    return [Conversation.from_json(d) for _, d in iter_jsonl(path)]


def read_tokenized(path: Path) -> list[TokenizedSample]:
    """Every :class:`TokenizedSample` of a JSONL file, in file order (tokenize's output)."""
    return [TokenizedSample.from_json(d) for _, d in iter_jsonl(path)]

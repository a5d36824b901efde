"""Read conversation datasets in the common formats and normalise them into :class:`~eyas.records.Conversation`.

Formats (``SourceConfig.format``; ``auto`` detects per row from its fields):
- ``sharegpt``: ``{"conversations": [{"from": "human"|"gpt"|"system", "value": str}, ...]}``
- ``openai``:   ``{"messages": [{"role": "user"|"assistant"|"system", "content": str}, ...]}``
  (either field may hold either turn layout: ``{"from", "value"}`` or ``{"role", "content"}``, the latter's
  content a string or a list of ``{"type": "text", "text": str}`` parts)
- ``ultrachat``: ``{"messages": [...]}`` as openai, or ``{"data": [user, assistant, user, ...]}``
- ``alpaca``:   ``{"instruction": str, "input": str, "output": str}`` (input appended to the instruction)
- ``gsm8k``:    ``{"question": str, "answer": str}``
- ``mt_bench``: ``{"turns": [str, ...]}`` (user turns only; replies come from generate)
- ``prompts``:  ``{"prompt": str}`` / ``{"text": str}`` rows, or a bare JSON string per row

Files: ``.json`` (a list of rows), ``.jsonl``, ``.parquet``, read directly. Anything else goes through the
``datasets`` library (``pip install 'eyas[data]'``): a folder written by ``Dataset.save_to_disk``, a folder of
data files (``load_dataset(folder)``), another data file type (``.csv``, ``.arrow``), or ``hub:<name>`` for a
Hugging Face Hub dataset where the network allows it (``SourceConfig.subset`` and ``split`` choose what is read).
Rows are located as ``file:line`` (JSONL), ``file:row N`` (JSON list, parquet) or ``name[split]:row N``
(``datasets``) in every error and skip record.

Normalisation rules (each counted in the prepare report):
- roles: human/user -> user; gpt/assistant/chatgpt/bard/bing/model -> assistant; system -> system; anything else
  skips the row ("unknown role");
- empty turns (nothing but whitespace or invisible format characters such as U+200B) are dropped;
- leading assistant turns (a conversation that starts with the assistant) are dropped;
- a system turn is kept when it comes first; later system turns are dropped;
- consecutive turns of the same role are merged, joined by a blank line;
- a row with no user turn left is skipped;
- text is kept byte for byte otherwise: no Unicode normalisation, no trimming, no length limit (long turns are
  truncated by tokenize at ``tokenize.max_length`` tokens, and counted there).
docs/data.md explains each rule with the dataset rows that need it.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..config import SourceConfig, resolve_path
from ..errors import DataError
from ..records import Conversation, Message, SkipCounter, SkipRecord

ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
    "system": "system",
}


@dataclass
class RawRow:
    where: str  # "file:line" or "file:row N"
    data: object


def read_rows(path: Path, max_rows: int | None = None) -> Iterator[tuple[RawRow | None, SkipRecord | None]]:
    """Yield raw rows of a JSON, JSONL or parquet file; a malformed JSONL line yields a skip record instead.

    Raises :class:`DataError` for a missing file, an unknown extension, or a JSON/parquet file that cannot be
    parsed as a whole.
    """
    if not path.exists():
        raise DataError(f"{path}: file not found")
    suffix = path.suffix.lower()
    n = 0
    if path.is_dir() or suffix not in (".json", ".jsonl", ".parquet"):
        yield from read_dataset_rows(str(path), max_rows=max_rows)
        return
    if suffix == ".jsonl":
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if max_rows is not None and n >= max_rows:
                    return
                where = f"{path}:{lineno}"
                if not raw.strip():
                    continue
                n += 1
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield None, SkipRecord(where, f"invalid UTF-8 at byte {e.start}")
                    continue
                try:
                    yield RawRow(where, json.loads(line)), None
                except json.JSONDecodeError as e:
                    yield None, SkipRecord(where, f"malformed JSON ({e.msg})")
    elif suffix == ".json":
        try:
            data = json.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: invalid UTF-8 at byte {e.start}") from None
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
        if isinstance(data, dict):
            data = [data]
        if not isinstance(data, list):
            raise DataError(f"{path}: a .json dataset must be a list of rows (got {type(data).__name__})")
        for i, row in enumerate(data[:max_rows] if max_rows else data, 1):
            yield RawRow(f"{path}:row {i}", row), None
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: reading parquet needs pyarrow (pip install 'eyas[data]')") from None
        try:
            table = pq.read_table(path)
        except Exception as e:  # pyarrow.ArrowInvalid and OSError for a truncated or foreign file
            raise DataError(f"{path}: cannot read it as parquet ({type(e).__name__}: {e})") from None
        if max_rows is not None:
            table = table.slice(0, max_rows)
        for i, row in enumerate(table.to_pylist(), 1):
            yield RawRow(f"{path}:row {i}", row), None


def read_dataset_rows(
    spec: str, split: str = "train", subset: str | None = None, max_rows: int | None = None
) -> Iterator[tuple[RawRow, None]]:
    """Yield the rows of a dataset loaded with the ``datasets`` library.

    ``spec`` is a folder written by ``save_to_disk``, a folder or file that ``datasets.load_dataset`` reads (data
    files such as ``.csv``/``.arrow``/``.jsonl``, or a loading script-free dataset folder), or ``hub:<name>``.
    Rows are located as ``<spec>[<split>]:row N``.

    Raises :class:`DataError` when ``datasets`` is not installed, the dataset or split does not exist, or it cannot
    be read (the library's own message is included).
    """
    try:
        import datasets
    except ImportError:
        raise DataError(f"{spec}: reading this source needs the `datasets` library "
                        f"(pip install 'eyas[data]')") from None
    name = spec[4:] if spec.startswith("hub:") else spec
    local = Path(name)
    try:
        if not spec.startswith("hub:") and local.is_dir() and (
            (local / "state.json").exists() or (local / "dataset_dict.json").exists()
        ):
            ds = datasets.load_from_disk(str(local))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DataError(f"{spec}: no split '{split}' (splits: {', '.join(ds)}); set the source's split")
                ds = ds[split]
        elif not spec.startswith("hub:") and local.is_file():
            builder = {".csv": "csv", ".tsv": "csv", ".arrow": "arrow", ".txt": "text"}.get(local.suffix.lower())
            if builder is None:
                raise DataError(f"{spec}: unknown file type '{local.suffix}' (expected .json, .jsonl, .parquet, "
                                f".csv, .arrow, or a dataset folder)")
            ds = datasets.load_dataset(builder, data_files=str(local), split="train")
        else:
            ds = datasets.load_dataset(name, subset, split=split)
    except DataError:
        raise
    except Exception as e:  # datasets raises many types (FileNotFoundError, DatasetNotFoundError, ValueError, ...)
        raise DataError(f"{spec}: the `datasets` library cannot load it ({type(e).__name__}: {e})") from None
    if max_rows is not None:
        ds = ds.select(range(min(max_rows, len(ds))))
    for i, row in enumerate(ds, 1):
        yield RawRow(f"{spec}[{split}]:row {i}", row), None


def detect_format(row: object) -> str | None:
    """Guess a row's format from its fields; None when nothing matches."""
    if isinstance(row, str):
        return "prompts"
    if not isinstance(row, dict):
        return None
    if "conversations" in row:
        return "sharegpt"
    if "messages" in row:
        return "openai"
    if "data" in row and isinstance(row.get("data"), list):
        return "ultrachat"
    if "instruction" in row:
        return "alpaca"
    if "question" in row and "answer" in row:
        return "gsm8k"
    if "turns" in row:
        return "mt_bench"
    if "prompt" in row or "text" in row:
        return "prompts"
    return None


class RowError(Exception):
    """A row-level problem: becomes a counted skip with its field."""

    def __init__(self, reason: str, field: str = ""):
        super().__init__(reason)
        self.reason, self.field = reason, field


def _str_field(row: dict, key: str, required: bool = True) -> str:
    if key not in row or row[key] is None:
        if required:
            raise RowError(f"missing field '{key}'", key)
        return ""
    v = row[key]
    if not isinstance(v, str):
        raise RowError(f"field '{key}' is {type(v).__name__}, expected a string", key)
    return v


# The two turn layouts datasets use, whichever field holds the list (``conversations`` or ``messages``): ShareGPT's
# ``{"from", "value"}`` and OpenAI's ``{"role", "content"}`` (many ShareGPT-style datasets on the Hub store OpenAI
# turns under ``conversations``). A turn is read with the layout whose role field it has.
TURN_LAYOUTS = (("from", "value"), ("role", "content"))


def _text_of(value, where: str) -> str:
    """A turn's text: a string, or OpenAI content parts ``[{"type": "text", "text": ...}, ...]`` joined in order.

    Raises :class:`RowError` for anything else (a non-text part: this toolkit trains on text)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        kinds = {p.get("type") for p in value}
        if kinds <= {"text"}:
            texts = [p.get("text") for p in value]
            if all(isinstance(x, str) for x in texts):
                return "".join(texts)
        raise RowError(f"{where} holds content parts of types {sorted(map(str, kinds))}; only 'text' parts are read",
                       where)
    raise RowError(f"{where} is {type(value).__name__}, expected a string", where)


def _turn_list(row: dict, key: str) -> list[tuple[str, str]]:
    turns = row.get(key)
    if not isinstance(turns, list):
        raise RowError(f"field '{key}' is {'missing' if turns is None else type(turns).__name__}, expected a list", key)
    out = []
    for j, t in enumerate(turns):
        if not isinstance(t, dict):
            raise RowError(f"{key}[{j}] is {type(t).__name__}, expected an object", f"{key}[{j}]")
        role_key, text_key = next(((r, x) for r, x in TURN_LAYOUTS if r in t), TURN_LAYOUTS[key == "messages"])
        role = t.get(role_key)
        if not isinstance(role, str):
            raise RowError(f"{key}[{j}] has no string '{role_key}' (a turn is {{\"from\", \"value\"}} or "
                           f"{{\"role\", \"content\"}})", f"{key}[{j}].{role_key}")
        text = _text_of(t.get(text_key), f"{key}[{j}].{text_key}")
        norm = ROLE_MAP.get(role.strip().lower())
        if norm is None:
            raise RowError(f"unknown role '{role}'", f"{key}[{j}].{role_key}")
        out.append((norm, text))
    return out


def row_to_turns(row: object, fmt: str) -> list[tuple[str, str]]:
    """Convert one raw row of format ``fmt`` into a list of ``(role, text)`` turns (roles already normalised)."""
    if fmt == "prompts":
        if isinstance(row, str):
            return [("user", row)]
        if not isinstance(row, dict):
            raise RowError(f"row is {type(row).__name__}, expected an object or a string")
        key = "prompt" if "prompt" in row else "text"
        return [("user", _str_field(row, key))]
    if not isinstance(row, dict):
        raise RowError(f"row is {type(row).__name__}, expected an object")
    if fmt == "sharegpt":
        return _turn_list(row, "conversations")
    if fmt == "openai":
        return _turn_list(row, "messages")
    if fmt == "ultrachat":
        if "messages" in row:
            return _turn_list(row, "messages")
        data = row.get("data")
        if not isinstance(data, list) or not all(isinstance(x, str) for x in data):
            raise RowError("field 'data' must be a list of strings", "data")
        return [("user" if j % 2 == 0 else "assistant", x) for j, x in enumerate(data)]
    if fmt == "alpaca":
        instr = _str_field(row, "instruction")
        inp = _str_field(row, "input", required=False)
        out = _str_field(row, "output", required=False)
        turns = [("user", f"{instr}\n\n{inp}" if inp.strip() else instr)]
        if out:
            turns.append(("assistant", out))
        return turns
    if fmt == "gsm8k":
        return [("user", _str_field(row, "question")), ("assistant", _str_field(row, "answer"))]
    if fmt == "mt_bench":
        turns = row.get("turns")
        if not isinstance(turns, list) or not all(isinstance(x, str) for x in turns):
            raise RowError("field 'turns' must be a list of strings", "turns")
        # MT-bench rows hold user turns only; a placeholder-free conversation: the assistant replies come from generate.
        return [("user", t) for t in turns]
    raise RowError(f"unknown format '{fmt}'")


def is_blank(text: str) -> bool:
    """True for text with nothing visible: whitespace and format characters (Unicode category Cf: U+200B zero-width
    space, U+FEFF byte-order mark, ...) only. Seen in ShareGPT scrapes as turns holding a lone U+200B."""
    return all(c.isspace() or unicodedata.category(c) == "Cf" for c in text)


def normalise_turns(turns: list[tuple[str, str]], where: str, skips: SkipCounter) -> list[Message]:
    """Apply the documented normalisation rules; every dropped or merged turn is counted in ``skips``.

    MT-bench style rows with several user turns and no assistant turn keep the user turns separate: they are later
    regenerated turn by turn. In every other case consecutive same-role turns are merged.
    """
    msgs: list[Message] = []
    only_users = all(r == "user" for r, _ in turns)
    for j, (role, text) in enumerate(turns):
        if is_blank(text):
            skips.add(SkipRecord(where, "empty turn dropped", f"turn {j}"))
            continue
        if role == "system":
            if msgs:
                skips.add(SkipRecord(where, "system turn after the first turn dropped", f"turn {j}"))
                continue
            msgs.append(Message("system", text))
            continue
        if role == "assistant" and not any(m.role == "user" for m in msgs):
            skips.add(SkipRecord(where, "leading assistant turn dropped", f"turn {j}"))
            continue
        if msgs and msgs[-1].role == role and not (only_users and role == "user"):
            skips.add(SkipRecord(where, f"consecutive {role} turns merged", f"turn {j}"))
            msgs[-1] = Message(role, msgs[-1].content + "\n\n" + text)
            continue
        msgs.append(Message(role, text))
    return msgs


def load_source(src: SourceConfig, skips: SkipCounter, stats: dict) -> Iterator[Conversation]:
    """Yield normalised conversations of one source; rows that cannot be used are counted in ``skips``.

    ``stats`` receives ``rows_read``, ``rows_kept`` and ``rows_skipped`` for this source.
    """
    stats.update(rows_read=0, rows_kept=0, rows_skipped=0, turns=0, skipped_by_reason={})
    by_reason: dict[str, int] = stats["skipped_by_reason"]

    def skip_row(rec: SkipRecord) -> None:
        skips.add(rec)
        stats["rows_skipped"] += 1
        by_reason[rec.reason] = by_reason.get(rec.reason, 0) + 1

    if src.path.startswith("hub:"):
        rows = read_dataset_rows(src.path, src.split, src.subset, src.max_rows)
    else:
        path = resolve_path(src.path)
        if path.exists() and (path.is_dir() or path.suffix.lower() not in (".json", ".jsonl", ".parquet")):
            rows = read_dataset_rows(str(path), src.split, src.subset, src.max_rows)
        else:
            rows = read_rows(path, src.max_rows)
    for raw, bad in rows:
        stats["rows_read"] += 1
        if bad is not None:
            skip_row(bad)
            continue
        fmt = src.format if src.format != "auto" else detect_format(raw.data)
        try:
            if fmt is None:
                keys = sorted(raw.data) if isinstance(raw.data, dict) else type(raw.data).__name__
                # One reason for every such row (counted together); the row's own fields go to the record's field.
                raise RowError("cannot tell the format from the row's fields; set format in the source",
                               f"fields {keys}" if isinstance(raw.data, dict) else "")
            turns = row_to_turns(raw.data, fmt)
        except RowError as e:
            skip_row(SkipRecord(raw.where, e.reason, e.field))
            continue
        msgs = normalise_turns(turns, raw.where, skips)
        if not any(m.role == "user" for m in msgs):
            skip_row(SkipRecord(raw.where, "no user turn"))
            continue
        stats["rows_kept"] += 1
        stats["turns"] += len(msgs)
        yield Conversation(id=Conversation.make_id(msgs), messages=msgs, source=raw.where)

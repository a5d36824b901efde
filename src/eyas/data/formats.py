"""Read conversation datasets in the common formats and normalise them into :class:`~eyas.records.Conversation`.

Formats (``SourceConfig.format``; ``auto`` detects per row from its fields):
- ``sharegpt``: ``{"conversations": [{"from": "human"|"gpt"|"system", "value": str}, ...]}``
- ``openai``:   ``{"messages": [{"role": "user"|"assistant"|"system", "content": str}, ...]}``
  (either field may hold either turn layout: ``{"from", "value"}`` or ``{"role", "content"}``, the latter's
  content a string or a list of ``{"type": "text", "text": str}`` parts), optionally with the logged answer
  ``"choices": [{"message": {...}, "finish_reason": ...}]`` as the last reply; an assistant turn's
  ``finish_reason`` (its own or its choice's) is kept: ``length`` marks a reply cut at the token limit; so is its
  reasoning, ``reasoning_content`` or ``reasoning`` (as servers name it; in either turn layout), which tokenize
  renders as the target's template does
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
- consecutive turns of the same role are merged, joined by a blank line (their reasoning too);
- an assistant turn's reasoning (``reasoning_content`` or ``reasoning``) is kept as given; a turn whose two fields
  differ, or whose reasoning field and inline ``<think>...</think>`` block in its content differ, skips the row
  (which one did the model emit?); when the two are the same, the inline copy is removed from the content; reasoning
  on a user or system turn is dropped; an assistant turn with reasoning but no answer is dropped;
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
from typing import NamedTuple

from ..config import SourceConfig, resolve_path
from ..errors import DataError
from ..records import Conversation, Message, SkipCounter, SkipRecord
from .chat import split_inline_reasoning

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


# Compression is told by the file's first bytes, never by its name (a '.json' that is gzipped, a '.gz' that is not).
_MAGIC = ((b"\x1f\x8b", "gzip"), (b"BZh", "bz2"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"))
_COMPRESSED_SUFFIXES = (".gz", ".gzip", ".bz2", ".xz", ".zst")


def compression_of(path: Path) -> str | None:
    """``gzip``, ``bz2``, ``xz`` or ``zstd`` from the file's magic bytes; None for an uncompressed file."""
    with open(path, "rb") as f:
        head = f.read(6)
    return next((name for magic, name in _MAGIC if head.startswith(magic)), None)


def _open_bytes(path: Path, compression: str | None):
    """A binary stream of the file's content, decompressed; zstd is refused with what to do (the standard library
    reads it only from Python 3.14)."""
    import bz2
    import gzip
    import lzma

    if compression == "zstd":
        raise DataError(f"{path}: zstd-compressed; decompress it (zstd -d) or recompress with gzip, bz2 or xz")
    opener = {"gzip": gzip.open, "bz2": bz2.open, "xz": lzma.open}.get(compression, open)
    return opener(path, "rb")


def file_kind(path: Path) -> str:
    """How a file's rows are read: ``json``, ``jsonl``, ``parquet``, ``csv``, ``tsv`` or ``datasets``.

    Compression is told by magic bytes, whatever the name says (a gzipped ``x.jsonl`` is read, a ``.gz`` suffix
    is dropped before the name is read), parquet by its ``PAR1`` magic; then the name's suffix (``.json``,
    ``.jsonl``/``.ndjson``, ``.csv``, ``.tsv``) decides; a file whose name tells nothing (no suffix, or ``x.gz``)
    is told by its first non-blank character: '[' is a JSON list of rows, '{' or '"' JSON Lines unless its first
    line alone does not parse (one pretty-printed object: JSON). Other suffixes (``.arrow``, ``.txt``) and folders
    go to the ``datasets`` library.
    Raises :class:`DataError` for a file whose content matches no known layout."""
    if path.is_dir():
        return "datasets"
    comp = compression_of(path)
    name = path.name.lower()
    if comp is not None:
        for suffix in _COMPRESSED_SUFFIXES:
            if name.endswith(suffix):
                name = name[: -len(suffix)]
                break
    suffix = Path(name).suffix
    named = {".csv": "csv", ".tsv": "tsv", ".json": "json", ".jsonl": "jsonl", ".ndjson": "jsonl",
             ".parquet": "parquet"}.get(suffix)
    with _open_bytes(path, comp) as f:
        head = f.read(1 << 16)
    if head.startswith(b"PAR1"):
        if comp is not None:
            raise DataError(f"{path}: a compressed parquet file; decompress it first (parquet compresses its "
                            f"columns itself)")
        return "parquet"
    if named is not None:
        return named
    if comp is None and suffix:
        return "datasets"
    first = head.lstrip()[:1]
    if first == b"[":
        return "json"
    if first in (b"{", b'"'):
        line = head.lstrip().split(b"\n", 1)[0]
        try:
            json.loads(line)
            return "jsonl"
        except (json.JSONDecodeError, UnicodeDecodeError):
            return "json"
    if not first:
        return "jsonl"  # empty: no rows
    raise DataError(f"{path}: cannot tell how to read it: not JSON ('[' or '{{' first), JSON Lines, parquet or CSV "
                    f"(starts with {head[:20]!r}); name it .csv/.tsv for delimited text")


def read_rows(path: Path, max_rows: int | None = None) -> Iterator[tuple[RawRow | None, SkipRecord | None]]:
    """Yield raw rows of a JSON, JSON Lines, parquet, CSV or TSV file, compressed (gzip, bz2, xz) or not
    (:func:`file_kind` says how it is read); other files and folders go through :func:`read_dataset_rows`.
    A malformed JSONL line yields a skip record instead of a row.

    Raises :class:`DataError` for a missing file, a file whose layout cannot be told, or a JSON/parquet file that
    cannot be parsed as a whole.
    """
    if not path.exists():
        raise DataError(f"{path}: file not found")
    kind = file_kind(path)
    if kind == "datasets":
        yield from read_dataset_rows(str(path), max_rows=max_rows)
        return
    comp = compression_of(path)
    n = 0
    if kind == "jsonl":
        with _open_bytes(path, comp) as f:
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
    elif kind == "json":
        with _open_bytes(path, comp) as f:
            blob = f.read()
        try:
            data = json.loads(blob.decode("utf-8"))
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
    elif kind in ("csv", "tsv"):
        yield from _read_delimited(path, comp, "\t" if kind == "tsv" else ",", max_rows)
    elif kind == "parquet":
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


def _read_delimited(path: Path, comp: str | None, delimiter: str, max_rows: int | None
                    ) -> Iterator[tuple[RawRow | None, SkipRecord | None]]:
    """Rows of a CSV/TSV file with a header line (the standard library's ``csv``), as ``{column: str}``, each
    located at ``file:line`` of the line where its record starts (a quoted field may span lines). A record with
    more fields than the header is skipped and counted. Fields are not size-limited (prompts can be long)."""
    import csv
    import io

    csv.field_size_limit(1 << 30)
    with _open_bytes(path, comp) as raw:
        text = io.TextIOWrapper(raw, encoding="utf-8-sig", newline="")
        reader = csv.DictReader(text, delimiter=delimiter)
        n, line = 0, 2
        try:
            for row in reader:
                if max_rows is not None and n >= max_rows:
                    return
                n += 1
                where = f"{path}:{line}"
                line = reader.line_num + 1
                if None in row:
                    yield None, SkipRecord(where, f"more fields than the header's {len(reader.fieldnames)}")
                    continue
                yield RawRow(where, row), None
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: invalid UTF-8 near line {line} (byte {e.start} of a read block)") from None
        except csv.Error as e:
            raise DataError(f"{path}:{line}: unreadable {delimiter!r}-delimited text ({e})") from None


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
    if "history" in row and isinstance(row.get("history"), list):
        return "history"
    if "instruction" in row:
        return "alpaca"
    if "question" in row and "answer" in row:
        return "gsm8k"
    if "turns" in row:
        return "mt_bench"
    if any(k in row for k in PROMPT_FIELDS):
        return "prompts"
    return None


# Columns that hold a one-turn row's prompt in the layouts users bring (``prompt``: awesome-chatgpt-prompts;
# ``text``: MBPP; ``query``: LeetCodeDataset). A row with more than one of them is ambiguous (LeetCodeDataset's
# ``prompt`` is its import header, its ``query`` the problem): the source must name the column (``fields.prompt``).
PROMPT_FIELDS = ("prompt", "text", "query")
# Alpaca-style replies: ``output`` (Alpaca, Evol-Instruct) or ``response`` (GPTeacher).
REPLY_FIELDS = ("output", "response")
# MT-Bench-101 style ``history`` pairs: the user's and the assistant's key of one exchange.
HISTORY_PAIRS = (("user", "bot"), ("user", "assistant"), ("human", "gpt"), ("human", "assistant"))


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


class Turn(NamedTuple):
    """One turn as a row gives it: the normalised role, the text and, for a turn of a row that says, how the reply
    ended (:func:`finish_reason_of`) and its reasoning text (:func:`reasoning_of`); the readers of layouts that never
    say give ``(role, text)``."""

    role: str
    text: str
    finish_reason: str | None = None
    reasoning: str | None = None


# Where a message carries its reasoning, as servers return it: ``reasoning_content`` (SGLang, DeepSeek's API, vLLM
# before 0.10; what chat templates read) and ``reasoning`` (vLLM >= 0.10 ``ChatMessage``). The first name wins.
REASONING_FIELDS = ("reasoning_content", "reasoning")
INLINE_COPY_REMOVED = "reasoning both in its field and inline in the content (identical): the inline copy removed"
NO_ANSWER = "assistant turn with reasoning but no answer dropped (its reasoning with it)"


def reasoning_of(t: dict, where: str, role: str, text: str) -> str | None:
    """A turn's reasoning: its ``reasoning_content`` or ``reasoning`` field (a string or text parts, kept as given),
    None when both are absent or blank.

    Raises :class:`RowError` for an assistant turn whose two fields differ, or whose reasoning field and inline
    ``<think>...</think>`` block in its content (:func:`~eyas.data.chat.split_inline_reasoning`) differ: which one
    the model emitted cannot be told, and rendered together they are a reply no model writes."""
    found = {k: _text_of(t[k], f"{where}.{k}") for k in REASONING_FIELDS if t.get(k) is not None}
    found = {k: v for k, v in found.items() if not is_blank(v)}
    if not found:
        return None
    key, reasoning = next(iter(found.items()))
    if role != "assistant":
        return reasoning   # dropped by normalise_turns, counted
    if len({v.strip() for v in found.values()}) > 1:
        raise RowError("assistant turn has both 'reasoning' and 'reasoning_content', and they differ; keep one",
                       f"{where}.reasoning")
    inline = split_inline_reasoning(text)
    if inline is not None and inline[0].strip() != reasoning.strip():
        raise RowError(f"assistant turn holds reasoning both in '{key}' and inline in its content "
                       f"(<think>...</think>), and they differ; keep one", f"{where}.{key}")
    return reasoning


# A reply's end as OpenAI-style rows write it (a message's or a choice's ``finish_reason``): cut at the token limit
# (OpenAI ``length``; ``max_tokens`` as Anthropic and others write it) or ended by the model (``stop``, a stop
# sequence, a tool call). Other values (``content_filter``, ``abort``) say neither: unknown, trained as today.
_FINISH_LENGTH = {"length", "max_tokens"}
_FINISH_STOP = {"stop", "eos", "end_turn", "stop_sequence", "tool_calls", "function_call"}


def finish_reason_of(value) -> str | None:
    """``"length"``, ``"stop"`` or ``None`` (absent or neither) for a row's ``finish_reason`` value."""
    if not isinstance(value, str):
        return None
    v = value.strip().lower()
    return "length" if v in _FINISH_LENGTH else "stop" if v in _FINISH_STOP else None


def _turn_list(row: dict, key: str) -> list[Turn]:
    turns = row.get(key)
    if not isinstance(turns, list):
        raise RowError(f"field '{key}' is {'missing' if turns is None else type(turns).__name__}, expected a list", key)
    out = []
    for j, t in enumerate(turns):
        if not isinstance(t, dict):
            raise RowError(f"{key}[{j}] is {type(t).__name__}, expected an object", f"{key}[{j}]")
        out.append(_turn(t, f"{key}[{j}]", TURN_LAYOUTS[key == "messages"]))
    return out


def _turn(t: dict, where: str, layout: tuple[str, str], finish=None) -> Turn:
    """One turn object in either layout (``layout`` when it has neither role field); ``finish``: the reply's
    finish reason when it is given beside the turn (a choice's) rather than in it."""
    role_key, text_key = next(((r, x) for r, x in TURN_LAYOUTS if r in t), layout)
    role = t.get(role_key)
    if not isinstance(role, str):
        raise RowError(f"{where} has no string '{role_key}' (a turn is {{\"from\", \"value\"}} or "
                       f"{{\"role\", \"content\"}})", f"{where}.{role_key}")
    text = _text_of(t.get(text_key), f"{where}.{text_key}")
    norm = ROLE_MAP.get(role.strip().lower())
    if norm is None:
        raise RowError(f"unknown role '{role}'", f"{where}.{role_key}")
    finish = finish_reason_of(t.get("finish_reason", finish)) if norm == "assistant" else None
    return Turn(norm, text, finish, reasoning_of(t, where, norm, text))


def _choice_turn(row: dict) -> list[Turn]:
    """The reply of a row logged with its chat-completion answer (``{"messages": [...], "choices": [{"message":
    {...}, "finish_reason": ...}]}``): the one choice's message, with the choice's finish reason; none without
    ``choices``. Several choices are several replies to one prompt: the row is skipped (keep one per row)."""
    choices = row.get("choices")
    if choices is None:
        return []
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise RowError("field 'choices' must be a list of objects", "choices")
    if len(choices) != 1:
        raise RowError(f"'choices' holds {len(choices)} replies to one prompt; keep one per row", "choices")
    msg = choices[0].get("message")
    if not isinstance(msg, dict):
        raise RowError("choices[0] has no 'message' object", "choices[0].message")
    return [_turn(msg, "choices[0].message", ("role", "content"), choices[0].get("finish_reason"))]


class AmbiguousRow(Exception):
    """A row whose layout fits more than one reading: the source must say which (an error, not a skip: every row of
    the file would be read the same wrong way)."""


def _one_of(row: dict, keys: tuple[str, ...], what: str, setting: str) -> str | None:
    """The single key of ``keys`` present in ``row``; None when none is; :class:`AmbiguousRow` when several are."""
    found = [k for k in keys if k in row and row[k] is not None]
    if len(found) > 1:
        raise AmbiguousRow(f"columns {found} could each be the {what}; name the one to read with the source's "
                           f"{setting} (columns found: {sorted(row)})")
    return found[0] if found else None


def _mapped_turns(row: object, fields) -> list[tuple[str, str]]:
    """A row read through the source's field mapping (``SourceConfig.fields``): system, prompt and reply columns."""
    if not isinstance(row, dict):
        raise RowError(f"row is {type(row).__name__}, expected an object with column '{fields.prompt}'")
    turns = []
    if fields.system:
        system = _str_field(row, fields.system, required=False)
        if system.strip():
            turns.append(("system", system))
    turns.append(("user", _str_field(row, fields.prompt)))
    if fields.response:
        reply = _str_field(row, fields.response, required=False)
        if reply:
            turns.append(("assistant", reply))
    return turns


def row_to_turns(row: object, fmt: str, fields=None) -> list[tuple[str, str] | Turn]:
    """Convert one raw row of format ``fmt`` into a list of ``(role, text)`` turns (roles already normalised; a
    :class:`Turn` where the layout can say how a reply ended).

    ``fields`` (:class:`~eyas.config.SourceFields`) names the prompt, reply and system columns and overrides the
    format. Raises :class:`RowError` (a counted skip) for a row that lacks what its format needs and
    :class:`AmbiguousRow` for a row that fits two readings (several prompt or reply columns)."""
    if fields is not None:
        return _mapped_turns(row, fields)
    if fmt == "prompts":
        if isinstance(row, str):
            return [("user", row)]
        if not isinstance(row, dict):
            raise RowError(f"row is {type(row).__name__}, expected an object or a string")
        key = _one_of(row, PROMPT_FIELDS, "prompt", "fields.prompt")
        if key is None:
            raise RowError(f"none of the prompt columns {list(PROMPT_FIELDS)} (columns found: {sorted(row)}); name "
                           f"the prompt column with the source's fields.prompt", "")
        return [("user", _str_field(row, key))]
    if not isinstance(row, dict):
        raise RowError(f"row is {type(row).__name__}, expected an object")
    if fmt == "history":
        return _history_turns(row)
    if fmt == "sharegpt":
        return _turn_list(row, "conversations")
    if fmt == "openai":
        return _turn_list(row, "messages") + _choice_turn(row)
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
        reply_key = _one_of(row, REPLY_FIELDS, "reply", "fields.response")
        out = _str_field(row, reply_key, required=False) if reply_key else ""
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


def _history_turns(row: dict) -> list[tuple[str, str]]:
    """``{"history": [{"user": str, "bot": str}, ...]}`` (MT-Bench-101): each exchange a user turn and its reply
    (``HISTORY_PAIRS`` gives the accepted key pairs; a missing or empty reply is left for generate to write)."""
    hist = row["history"]
    out = []
    for j, pair in enumerate(hist):
        if not isinstance(pair, dict):
            raise RowError(f"history[{j}] is {type(pair).__name__}, expected an object", f"history[{j}]")
        keys = next(((u, a) for u, a in HISTORY_PAIRS if u in pair and a in pair), None) or next(
            ((u, a) for u, a in HISTORY_PAIRS if u in pair), None)
        if keys is None:
            raise RowError(f"history[{j}] has none of the user keys {sorted({u for u, _ in HISTORY_PAIRS})} "
                           f"(keys found: {sorted(pair)})", f"history[{j}]")
        user_key, bot_key = keys
        out.append(("user", _text_of(pair.get(user_key), f"history[{j}].{user_key}")))
        reply = _text_of(pair.get(bot_key), f"history[{j}].{bot_key}")
        if reply:
            out.append(("assistant", reply))
    return out


def is_blank(text: str) -> bool:
    """True for text with nothing visible: whitespace and format characters (Unicode category Cf: U+200B zero-width
    space, U+FEFF byte-order mark, ...) only. Seen in ShareGPT scrapes as turns holding a lone U+200B."""
    return all(c.isspace() or unicodedata.category(c) == "Cf" for c in text)


def normalise_turns(turns: list[tuple[str, str] | Turn], where: str, skips: SkipCounter) -> list[Message]:
    """Apply the documented normalisation rules; every dropped or merged turn is counted in ``skips``.

    MT-bench style rows with several user turns and no assistant turn keep the user turns separate: they are later
    regenerated turn by turn. In every other case consecutive same-role turns are merged (a merged reply ends as
    its last part did: that part's finish reason; the parts' reasoning is joined by a blank line).
    """
    msgs: list[Message] = []
    turns = [Turn(*t) for t in turns]
    only_users = all(t.role == "user" for t in turns)
    for j, (role, text, finish, reasoning) in enumerate(turns):
        if reasoning is not None and role != "assistant":
            skips.add(SkipRecord(where, f"reasoning on a {role} turn dropped", f"turn {j}"))
            reasoning = None
        if reasoning is not None and (inline := split_inline_reasoning(text)) is not None:
            skips.add(SkipRecord(where, INLINE_COPY_REMOVED, f"turn {j}"))   # reasoning_of: the two are the same
            text = inline[1]
        if is_blank(text):
            skips.add(SkipRecord(where, "empty turn dropped" if reasoning is None else NO_ANSWER, f"turn {j}"))
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
            prev = msgs[-1]
            joined = "\n\n".join(r for r in (prev.reasoning_content, reasoning) if r) or None
            msgs[-1] = Message(role, prev.content + "\n\n" + text, reasoning_content=joined, finish_reason=finish)
            continue
        msgs.append(Message(role, text, reasoning_content=reasoning, finish_reason=finish))
    return msgs


def reasoning_kind(m: Message) -> str | None:
    """Where an assistant message carries its reasoning: ``"field"`` (``reasoning_content``), ``"inline"`` (a
    ``<think>`` block with text in its content, which the template parses, or renders verbatim), or None."""
    if m.role != "assistant":
        return None
    if m.reasoning_content:
        return "field"
    inline = split_inline_reasoning(m.content)
    return "inline" if inline is not None and not is_blank(inline[0]) else None


def source_rows(src: SourceConfig) -> Iterator[tuple[RawRow | None, SkipRecord | None]]:
    """The raw rows of one source (``hub:`` names and ``datasets`` files and folders through the library, the rest
    through :func:`read_rows`), each with its location; what :func:`load_source` normalises."""
    if src.path.startswith("hub:"):
        return read_dataset_rows(src.path, src.split, src.subset, src.max_rows)
    path = resolve_path(src.path)
    if path.exists() and file_kind(path) == "datasets":
        return read_dataset_rows(str(path), src.split, src.subset, src.max_rows)
    return read_rows(path, src.max_rows)


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

    for raw, bad in source_rows(src):
        stats["rows_read"] += 1
        if bad is not None:
            skip_row(bad)
            continue
        fmt = src.format if src.format != "auto" else detect_format(raw.data)
        try:
            if fmt is None and src.fields is None:
                keys = sorted(raw.data) if isinstance(raw.data, dict) else type(raw.data).__name__
                # One reason for every such row (counted together); the row's own fields go to the record's field.
                raise RowError("cannot tell the format from the row's fields; set format in the source",
                               f"fields {keys}" if isinstance(raw.data, dict) else "")
            turns = row_to_turns(raw.data, fmt, src.fields)
        except AmbiguousRow as e:
            raise DataError(f"{raw.where}: {e}") from None
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

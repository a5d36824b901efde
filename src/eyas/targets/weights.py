"""What a target's checkpoint holds, read from its safetensors headers only, and the check that it holds every
tensor its config requires, made before a stage loads the weights (issue 19).

Why a check of our own: transformers fills a tensor the checkpoint lacks with fresh random values (with a log line
nobody reads), and a folder whose index names a missing shard, or that holds no weights at all, fails deep inside the
loader with a raw ``OSError``. A config saying ``tie_word_embeddings: false`` over a checkpoint without
``lm_head.weight`` used to pass every stage: the embedding table stood in for the lm_head, so every soft label came
from the wrong matrix.

Layout read (what ``save_pretrained(safe_serialization=True)`` writes, as every Hugging Face checkpoint is laid out):
either ``model.safetensors.index.json``, whose ``weight_map`` maps every tensor name to the file holding it, or one
or more ``*.safetensors`` files without an index (``model.safetensors``; a series ``model-00001-of-00003.safetensors``
...). Each file's header (names, dtypes, shapes, offsets) is read once with plain reads, and its size compared with the
data the header describes, so a truncated file is caught; no tensor data is read or mapped, so a checkpoint of
thousands of shards costs the reading of their headers (Kimi-K2's 70K tensors in 1,000 shards: about 0.5 s on a
2-core CPU).

Required (:func:`required_tensors`), in the Llama-like layout of every family in :mod:`eyas.families`:
- ``model.embed_tokens.weight`` ``[vocab_size, hidden_size]``: the drafter's frozen token embedding;
- ``lm_head.weight`` ``[vocab_size, hidden_size]``, unless the config ties it to the embedding
  (``tie_word_embeddings``; when config.json does not say, the config class's default, as transformers reads it):
  the soft labels are computed with it;
- ``model.norm.weight``: the final norm (the last hidden state is taken after it);
- some tensor of each decoder layer ``model.layers.{i}.`` for ``i < num_hidden_layers``.
Which tensors a layer needs inside varies by family (MoE experts, MLA projections, transformers' own key renames)
and is left to the loader.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from ..families import text_config
from ..store.shards import read_safetensors_header

INDEX = "model.safetensors.index.json"
EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
FINAL_NORM = "model.norm.weight"
LAYER_PREFIX = "model.layers."
_SERIES = re.compile(r"^(?P<stem>.+)-(?P<i>\d+)-of-(?P<n>\d+)\.safetensors$")
_OTHER_FORMATS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.h5", "*.msgpack")
_MAX_LINES = 8  # problems of one kind listed before "... and N more" (an index of 1,000 shards, none downloaded)


@dataclass
class TargetWeights:
    """The tensors of a target folder's checkpoint, from the file headers (no data read).

    ``files``: the weight files (names relative to ``folder``): those the index names, else every ``*.safetensors``.
    ``indexed``: read through ``model.safetensors.index.json``. ``tensors``: tensor name -> the file holding it
    (from the readable files' headers, and from the index for files that are missing or unreadable).
    ``shapes``: name -> shape, for the required tensors found in a readable file.
    """

    folder: Path
    files: list[str]
    indexed: bool
    tensors: dict[str, str] = field(default_factory=dict)
    shapes: dict[str, list[int]] = field(default_factory=dict)

    def describe(self) -> str:
        """The checkpoint's files in a few words, for messages."""
        if self.indexed:
            return f"the {len(self.files)} files {INDEX} names"
        return self.files[0] if len(self.files) == 1 else f"the {len(self.files)} .safetensors files"


def has_weights(folder: Path) -> bool:
    """True when ``folder`` holds a weights file (readable or not): any ``*.safetensors``, or a file its index
    names. A folder of config and tokenizer files, with or without the index, has none."""
    if any(folder.glob("*.safetensors")):
        return True
    try:
        named = set(json.loads((folder / INDEX).read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # no index, or one read_weights reports
        return (folder / INDEX).exists()
    return any((folder / f).exists() for f in named)


def tied_embeddings(folder: Path, target_cfg: dict, trust_remote_code: bool = False) -> tuple[bool | None, str]:
    """Whether the target's lm_head is its embedding table, and where that was read, for messages:
    config.json's ``tie_word_embeddings``, else the config class's default (through ``AutoConfig``). ``None``
    when neither tells (a ``model_type`` this transformers does not know, without its remote code)."""
    for d in (text_config(target_cfg), target_cfg):
        if "tie_word_embeddings" in d:
            v = bool(d["tie_word_embeddings"])
            return v, f"config.json says tie_word_embeddings: {str(v).lower()}"
    try:
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception:  # unknown model_type, remote code not trusted: the loader will say so itself
        return None, "config.json does not set tie_word_embeddings"
    v = getattr(c, "tie_word_embeddings", None)
    if v is None:
        v = getattr(c.get_text_config(), "tie_word_embeddings", None)
    if v is None:
        return None, "config.json does not set tie_word_embeddings"
    return bool(v), (f"config.json does not set tie_word_embeddings and {type(c).__name__}'s default is "
                     f"{str(bool(v)).lower()}")


def required_tensors(tied: bool | None) -> list[str]:
    """The tensor names a target must hold (the module docstring says why each), layers aside; ``tied``
    (:func:`tied_embeddings`): the lm_head is required only when the config says it is not tied."""
    return [EMBED] + ([LM_HEAD] if tied is False else []) + [FINAL_NORM]


def _capped(lines: list[str], what: str) -> list[str]:
    if len(lines) <= _MAX_LINES:
        return lines
    return lines[:_MAX_LINES] + [f"... and {len(lines) - _MAX_LINES} more {what}"]


def _held(names: list[str], required: list[str]) -> str:
    """'the index puts 24 tensors in it, lm_head.weight among them' (required ones named first); '' for none."""
    first = [n for n in required if n in names] or names[:1]
    if not first:
        return ""
    if len(names) == len(first):
        return f"the index puts {', '.join(first)} in it"
    return f"the index puts {len(names)} tensors in it, {', '.join(first)} among them"


def read_weights(folder: Path, required: list[str] = ()) -> tuple[TargetWeights | None, list[str]]:
    """The folder's checkpoint (:class:`TargetWeights`) and the problems met reading it: no weights file, an index
    that is not valid, files it names that are missing or unreadable, tensors it maps to a file that lacks them, a
    ``-0000i-of-0000N`` series with files missing. ``required``: names put first where a file's tensors are named.
    Reads only the index and the file headers."""
    required = list(required)
    index = folder / INDEX
    weight_map: dict[str, str] | None = None
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map is not a mapping of tensor name -> file")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            what = "no \"weight_map\" in it" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
            return None, [f"{INDEX}: not a readable safetensors index ({what}): re-download it, or delete it to "
                          f"read the .safetensors files beside it"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        other = sorted({p.name for pat in _OTHER_FORMATS for p in folder.glob(pat)})
        if other:
            hint = (f"it holds {', '.join(other[:3])}{' ...' if len(other) > 3 else ''}, which Eyas does not read "
                    f"(targets are read from safetensors): save the model with "
                    f"save_pretrained(folder, safe_serialization=True)")
        else:
            hint = "put the checkpoint's .safetensors files (and its index, if sharded) next to config.json"
        where = f"{INDEX} names no file" if weight_map is not None else (
            f"neither model.safetensors, {INDEX} nor any other .safetensors file is in the folder")
        return None, [f"no weights file: {where}; {hint}"]
    w = TargetWeights(folder=folder, files=files, indexed=weight_map is not None)
    by_file: dict[str, list[str]] = {}
    for name, f in (weight_map or {}).items():
        by_file.setdefault(f, []).append(name)
    missing, unreadable, lacking = [], [], []
    for f in files:
        p = folder / f
        mapped = by_file.get(f, [])
        if not p.is_file():
            missing.append(f"{f}: named by {INDEX} but not in the folder ({_held(mapped, required)}): download it")
            w.tensors.update({n: f for n in mapped})
            continue
        try:   # the header only, read (not mapped: a 30 GB shard is no 30 GB mapping on a laptop that plans)
            _, meta = read_safetensors_header(p)
            keys = set(meta) - {"__metadata__"}
            w.shapes.update({n: list(meta[n]["shape"]) for n in required if n in keys})
        except (ValueError, OSError, KeyError, TypeError) as e:
            held = _held(mapped, required)
            if isinstance(e, OSError):
                why = e.strerror or str(e)
            elif isinstance(e, ValueError):   # too short, not JSON, or a size other than the header describes
                why = str(e)
            else:
                why = f"a malformed header entry ({type(e).__name__}: {e})"
            unreadable.append(f"{f}: not a readable safetensors file ({why}){'; ' + held if held else ''}: "
                              f"re-download or re-save it")
            w.tensors.update({n: f for n in mapped})
            continue
        w.tensors.update({n: f for n in keys})
        absent = [n for n in mapped if n not in keys]
        if absent:
            first = [n for n in required if n in absent] or absent[:3]
            lacking.append(f"{f}: {INDEX} maps {len(absent)} tensors to it that it does not hold "
                           f"({', '.join(first)}{' ...' if len(absent) > len(first) else ''}): the index and the "
                           f"file are from different checkpoints; re-download both")
            for n in absent:
                del w.tensors[n]
    series = []
    if weight_map is None:  # shards without an index: their names say how many there are
        groups: dict[tuple[str, int, int], set[int]] = {}
        for f in files:
            m = _SERIES.match(f)
            if m:
                groups.setdefault((m["stem"], int(m["n"]), len(m["i"])), set()).add(int(m["i"]))
        for (stem, n, width), have in sorted(groups.items()):
            for i in sorted(set(range(1, n + 1)) - have):
                series.append(f"{stem}-{i:0{width}d}-of-{n:0{width}d}.safetensors: not in the folder ({len(have)} "
                              f"of the {n} files of the series are, and there is no {INDEX}): download it")
    problems = (_capped(missing, "missing files") + _capped(unreadable, "unreadable files")
                + _capped(lacking, "files") + _capped(series, "missing files"))
    return w, problems


def _ranges(ids: list[int]) -> str:
    """[3, 4, 5, 9] -> '3-5, 9'."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def weights_problems(folder: Path, target_cfg: dict, trust_remote_code: bool = False
                     ) -> tuple[TargetWeights | None, list[str]]:
    """Every problem of the folder's checkpoint at once (:func:`read_weights`, then the required tensors and the
    shapes of the embedding and lm_head against the config); each names the file or the tensor."""
    tied, tie_source = tied_embeddings(folder, target_cfg, trust_remote_code)
    required = required_tensors(tied)
    w, problems = read_weights(folder, list(dict.fromkeys(required + [LM_HEAD])))
    if w is None:
        return None, problems
    c = text_config(target_cfg)
    why = {
        EMBED: "Eyas reads the target's token embedding from it (the drafter shares it)",
        LM_HEAD: (f"{tie_source}, so the lm_head is a matrix of its own, not the embedding table, and every soft "
                  f"label is computed with it: add it to the checkpoint, or set tie_word_embeddings: true in "
                  f"config.json if the model does share its embedding"),
        FINAL_NORM: "it is the final norm the last hidden state passes through",
    }
    for name in required:
        if name not in w.tensors:
            problems.append(f"{name}: in none of {w.describe()}; {why[name]}")
    n_layers = c.get("num_hidden_layers")
    if isinstance(n_layers, int) and any(k.startswith(LAYER_PREFIX) for k in w.tensors):
        have = {int(m[1]) for k in w.tensors if (m := re.match(r"model\.layers\.(\d+)\.", k))}
        absent = [i for i in range(n_layers) if i not in have]
        if absent:
            problems.append(f"{LAYER_PREFIX}{{{_ranges(absent)}}}.*: no tensor of decoder layer"
                            f"{'s' if len(absent) > 1 else ''} {_ranges(absent)} in {w.describe()}, but config.json "
                            f"says num_hidden_layers: {n_layers}")
    V, H = c.get("vocab_size"), c.get("hidden_size")
    if isinstance(V, int) and isinstance(H, int):
        for name in (EMBED, LM_HEAD):
            shape = w.shapes.get(name)
            if shape is not None and shape != [V, H]:
                problems.append(f"{name} in {w.tensors[name]} is {shape}, but config.json says vocab_size {V} and "
                                f"hidden_size {H} ([{V}, {H}]): the config and the weights are of different models")
    return w, problems


_PASSED: dict[tuple, TargetWeights] = {}  # folders that passed, by their files' names, sizes and times (per process)


def _signature(folder: Path) -> tuple:
    entries = sorted((p.name, s.st_size, s.st_mtime_ns) for p in folder.iterdir()
                     if p.suffix in (".safetensors", ".json") and (s := p.stat()))
    return (str(folder.resolve()), tuple(entries))


def check_target_weights(folder: Path, target_cfg: dict, trust_remote_code: bool = False,
                         reason: str = "its weights are loaded") -> TargetWeights:
    """Refuse a target folder whose checkpoint does not hold what its config requires (:func:`weights_problems`);
    return what it holds. ``reason``: why the weights are needed (``"extract loads its weights"``), for the message.
    A folder that passed is not read again in this process while its files are unchanged.

    Raises :class:`ConfigError` listing every problem, each naming the file or the tensor.
    """
    sig = _signature(folder)
    if sig in _PASSED:
        return _PASSED[sig]
    w, problems = weights_problems(folder, target_cfg, trust_remote_code)
    if problems:
        raise ConfigError(f"target.model: {folder} does not hold a usable checkpoint ({reason}); refused before any "
                          f"work:\n  " + "\n  ".join(problems))
    _PASSED[sig] = w
    return w


def check_target(cfg, reason: str) -> TargetWeights:
    """:func:`check_target_weights` for a :class:`~eyas.config.TargetConfig`; a GGUF or llama2.c target is checked
    as the folder it is converted to (converted first, once, as every stage that reads it does)."""
    from .load import materialize_target

    folder = materialize_target(cfg)
    return check_target_weights(folder, json.loads((folder / "config.json").read_text()), cfg.trust_remote_code,
                                reason)

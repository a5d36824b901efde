"""How many bytes a store takes, and whether its disk can hold them (issue 12: extract must not start a job the disk
cannot finish; ``eyas plan`` warns before that).

Per token the store writes (:meth:`eyas.store.shards.ShardWriter.prepare`): ``input_ids`` as int32 (4 bytes), the
``L`` aux states (``L * H`` values in ``extract.dtype``, or ``L * H`` float8 values plus one float32 scale per layer
with ``aux_format: float8_e4m3fn``) and the last state (``H`` values in ``extract.dtype``). Shard headers and
manifest lines add a few hundred bytes per sample (:data:`SAMPLE_OVERHEAD_BYTES`). With ``extract.labels: topk`` the
last state gives way to ``k`` int16 draft ids, ``k`` float16 probabilities and one flag byte.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..dtypes import DTYPES
from ..errors import StoreError
from .labels import label_bytes_per_token

ID_BYTES = 4  # input_ids are stored as int32
# A sample's entries in its shard's safetensors header (3 or 4 tensors: name, dtype, shape, offsets) and in the
# manifest line (id, tokens, sha256, shapes): about 500 bytes for Eyas's 16-character ids, rounded up.
SAMPLE_OVERHEAD_BYTES = 640


def hidden_state_bytes_per_token(hidden_size: int, num_aux: int, dtype: str = "bfloat16",
                                 aux_fp8: bool = False) -> int:
    """Bytes of one token's hidden states: ``num_aux`` aux states plus the last state (ids not counted).

    bf16: ``(num_aux + 1) * H * 2``; ``aux_fp8``: ``num_aux * (H + 4) + H * bytes(dtype)`` (e4m3 values, one fp32
    scale per token and layer, last state unquantised). Raises ``KeyError`` for an unknown dtype.
    """
    b = DTYPES[dtype].itemsize
    aux = num_aux * (hidden_size + 4) if aux_fp8 else num_aux * hidden_size * b
    return aux + hidden_size * b


def store_bytes_per_token(hidden_size: int, num_aux: int, dtype: str, aux_format: str, label_topk: int = 0,
                          draft_vocab_size: int = 0) -> int:
    """Bytes the store writes per token: hidden states as configured plus the int32 token id. ``label_topk`` > 0:
    top-k labels (:mod:`eyas.store.labels`, ``4k + 1`` bytes for a draft vocabulary of at most 32,767 ids) take
    the place of the last hidden state."""
    b = hidden_state_bytes_per_token(hidden_size, num_aux, dtype, aux_fp8=aux_format == "float8_e4m3fn") + ID_BYTES
    if label_topk:
        b += label_bytes_per_token(label_topk, draft_vocab_size) - hidden_size * DTYPES[dtype].itemsize
    return b


def header_bytes_per_token(header) -> int:
    """:func:`store_bytes_per_token` of a store with this :class:`~eyas.store.shards.StoreHeader`."""
    return store_bytes_per_token(header.hidden_size, len(header.layer_ids), header.dtype, header.aux_format,
                                 header.label_topk if header.topk else 0, header.draft_vocab_size)


def disk_free(path: Path) -> tuple[Path, int]:
    """``(existing folder, free bytes)`` of the disk that holds ``path`` (which need not exist yet): the free space
    a non-privileged writer gets there (``shutil.disk_usage``)."""
    p = Path(path).expanduser().absolute()
    while not p.exists():
        p = p.parent
    return p, shutil.disk_usage(p).free


def check_disk_space(need_bytes: int, path: Path, *, ignore: bool, what: str, log=print) -> int:
    """Refuse to start writing ``need_bytes`` under ``path`` when its disk has less free.

    Returns the free bytes. Raises :class:`StoreError` naming both figures and the ways out, unless ``ignore``
    (then it logs a warning and returns).
    """
    from ..plan import human_bytes

    where, free = disk_free(path)
    if need_bytes <= free:
        return free
    msg = (f"{what} needs {human_bytes(need_bytes)} ({need_bytes:,} bytes) under {path}; the disk holding {where} has "
           f"{human_bytes(free)} ({free:,} bytes) free")
    if ignore:
        log(f"[eyas] warning: {msg}; going on (extract.ignore_disk_space)")
        return free
    raise StoreError(f"{msg}. Refused before writing anything: free space or move run_dir, store fp8 aux states "
                     f"(extract.aux_format: float8_e4m3fn), train online (train.mode: online, nothing stored) or cut "
                     f"samples (tokenize.max_length); `eyas plan CONFIG` gives the size of each choice. To start "
                     f"anyway (space freed while it runs), set extract.ignore_disk_space: true")

"""What a run's store must be: the aux layer ids it captures and the header (:class:`StoreHeader`) that pins the
run, the target, the tokenizer, the layers and the storage format. Used by extraction (to create or refuse a
store), by online training (the same header, nothing stored) and by ``eyas doctor`` (is this store the run's?)."""

from __future__ import annotations

from pathlib import Path

from ..capture import engine_info
from ..config import ExtractConfig, TargetConfig
from ..errors import ConfigError
from ..families import STORE_CONVENTION, check_layer_ids, default_aux_layer_ids, text_config
from ..io import read_json, sha256_bytes, sha256_file
from ..run_folder import RunFolder
from ..targets.load import materialize_target, read_target_config
from .shards import StoreHeader, read_safetensors_header


def aux_layer_ids(target: TargetConfig, extract: ExtractConfig) -> list[int]:
    """The configured aux layer ids (``extract.layer_ids``), or the target family's engine default
    ``[1, N//2-1, N-4]``; ``output_of_layer`` convention. Raises :class:`ConfigError` when they do not fit."""
    tcfg = read_target_config(target)
    n = int(text_config(tcfg)["num_hidden_layers"])
    ids = extract.layer_ids or default_aux_layer_ids(n, tcfg)
    check_layer_ids(ids, n)
    return ids


def weights_fingerprint(path: Path) -> str:
    """sha256 over each safetensors file's name, size and header (tensor names, dtypes, shapes, offsets).

    Cheap (a few KiB per file) and enough to tell checkpoints apart; a change of weight values that keeps every
    shape and file size is not seen (the target folder's ``config.json`` hash is recorded beside it).
    """
    parts = []
    for f in sorted(Path(path).glob("*.safetensors")):
        try:
            raw, _ = read_safetensors_header(f)
        except ValueError as e:
            raise ConfigError(f"{f}: not a readable safetensors file ({e})") from None
        parts += [f.name.encode(), str(f.stat().st_size).encode(), raw]
    return sha256_bytes(*parts)


def expected_header(target: TargetConfig, extract: ExtractConfig, run: RunFolder,
                    engine: dict | None = None) -> StoreHeader:
    """The header the run's store must have: run id, target and tokenizer identity (from tokenize's meta), aux
    layers, dtype, aux format and the capture engine (``engine``, default: the configured backend's)."""
    tcfg = text_config(read_target_config(target))
    path = materialize_target(target)
    meta = read_json(run.tokenize_meta)
    labels = label_fields(extract, run)
    return StoreHeader(
        run_id=run.run_id(),
        target={"path": str(path), "config_sha256": sha256_file(path / "config.json"),
                "weights_sha256": weights_fingerprint(path),
                "num_layers": int(tcfg["num_hidden_layers"]), "hidden_size": int(tcfg["hidden_size"])},
        tokenizer=meta["tokenizer"],
        layer_ids=aux_layer_ids(target, extract),
        layer_convention=STORE_CONVENTION,
        last_hidden="post_norm",
        hidden_size=int(tcfg["hidden_size"]),
        dtype=extract.dtype,
        aux_format=extract.aux_format,
        engine=engine or engine_info(extract.backend, target, extract),
        **labels,
    )


def label_fields(extract: ExtractConfig, run: RunFolder) -> dict:
    """The header's label fields: ``{}`` (the last hidden state is stored) or, for ``extract.labels: topk``, the
    format, k and the draft vocabulary the labels are made over (its size and the sha256 of
    ``RUN/vocab/vocab.safetensors``). Raises :class:`ConfigError` when the vocab stage has not written one."""
    if extract.labels != "topk":
        return {}
    if not run.vocab.exists():
        raise ConfigError(f"extract.labels: topk keeps the target's distribution over the draft vocabulary, and "
                          f"{run.vocab} does not exist: run `eyas vocab CONFIG` before extract (`eyas run` does)")
    from safetensors import safe_open

    with safe_open(str(run.vocab), framework="pt") as f:
        dv = int(f.get_slice("d2t").get_shape()[0])
    if extract.label_topk > dv:
        raise ConfigError(f"extract.label_topk: {extract.label_topk} is more than the draft vocabulary's {dv} ids")
    return {"label_format": "topk", "label_topk": extract.label_topk, "draft_vocab_size": dv,
            "draft_vocab_sha256": sha256_file(run.vocab)}

"""Hidden-state capture backends behind one small Protocol.

A backend receives the run's tokenized samples (each with its dataset id) and yields, per sample, the aux hidden
states at the requested layers and the post-norm last hidden state, exactly sliced to the sample's tokens.
Capture is keyed by sample id (FIELD_NOTES, extraction rule 1): the extract stage writes only what comes back
under an id it asked for, with the token ids it asked for, so warm-up or health-check requests of an engine can
never reach the store.

Backends: ``transformers`` (in-process, :mod:`eyas.capture.transformers_backend`); ``vllm`` (vLLM's own
``extract_hidden_states`` method with Eyas's connector, :mod:`eyas.capture.vllm_backend`). Config ``extract.backend``
selects one through :data:`BACKENDS`; a backend module exposes ``make_backend(target_cfg, extract_cfg, layer_ids,
device)`` returning a :class:`CaptureBackend`, and ``engine_info(target_cfg, extract_cfg)`` (the engine identity
recorded in the store header, without loading the model).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..records import TokenizedSample


@dataclass
class CapturedSample:
    """States of one sample, on the CPU.

    ``input_ids`` int [T] (the ids the target saw); ``aux`` [T, L, H]: outputs of the aux layers in
    ``output_of_layer`` order, in the store dtype, or float8_e4m3fn when ``aux_scale`` float32 [T, L] is given
    (:mod:`eyas.store.fp8`); ``last`` [T, H]: post-norm last hidden state in the store dtype, or None once
    ``labels`` (:class:`~eyas.store.labels.CompactLabels` of the T tokens, a top-k store) were made from it.
    ``finite``: the backend checked on its device that every value of ``aux`` and ``last`` is finite (else the
    writer checks).
    """

    sample_id: str
    input_ids: torch.Tensor
    aux: torch.Tensor
    last: torch.Tensor | None
    aux_scale: torch.Tensor | None = None
    finite: bool = False
    labels: object | None = None


@runtime_checkable
class CaptureBackend(Protocol):
    """What the extract stage needs from a capture backend."""

    #: engine identity for the store header, e.g. ``{"name": "transformers", "version": "5.19.0"}``
    engine: dict

    def capture(self, samples: Sequence[TokenizedSample]) -> Iterator[CapturedSample]:
        """Yield one :class:`CapturedSample` per input sample (any order), keyed by ``TokenizedSample.id``.

        Layer ids are ``output_of_layer`` (0-based decoder layer whose output is captured); a backend whose engine
        counts otherwise converts them itself (:func:`eyas.families.convert_layer_ids`).
        """
        ...

    def close(self) -> None:
        """Release the engine (hooks, processes, GPU memory)."""
        ...


#: ``extract.backend`` value -> module exposing ``make_backend``.
BACKENDS = {"transformers": "eyas.capture.transformers_backend", "vllm": "eyas.capture.vllm_backend"}


def make_backend(name: str, target_cfg, extract_cfg, layer_ids: list[int], device: str | None) -> CaptureBackend:
    """Build the configured backend (``extract.backend``); ``device`` overrides ``target.device`` (per rank)."""
    from importlib import import_module

    from ..errors import ConfigError

    if name not in BACKENDS:
        raise ConfigError(f"extract.backend: unknown backend '{name}' (known: {', '.join(sorted(BACKENDS))})")
    return import_module(BACKENDS[name]).make_backend(target_cfg, extract_cfg, layer_ids, device)


def engine_info(name: str, target_cfg, extract_cfg) -> dict:
    """The configured backend's engine identity (name, versions, compute dtype), without loading the model."""
    from importlib import import_module

    from ..errors import ConfigError

    if name not in BACKENDS:
        raise ConfigError(f"extract.backend: unknown backend '{name}' (known: {', '.join(sorted(BACKENDS))})")
    return import_module(BACKENDS[name]).engine_info(target_cfg, extract_cfg)

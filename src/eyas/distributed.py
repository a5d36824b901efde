"""Distribution, applied in one place: a small context object that is a no-op on one process.

``torchrun --nproc-per-node N -m eyas.cli train CONFIG`` (or ``extract``) starts N processes; :meth:`Dist.from_env`
joins them (NCCL on CUDA, gloo on CPU). Training: :meth:`Dist.wrap` wraps the draft once, with DDP or FSDP2
(``fully_shard``), as ``train.distributed`` says. Extraction: each process takes its share of the batch plan and
meets the others at :meth:`Dist.barrier`. The loop does not branch on the strategy or the process count: it calls
:meth:`Dist.all_reduce`, :meth:`Dist.model_state` and friends, which are identities on one process; the one thing
it asks is :attr:`Dist.is_main`, because only process 0 writes metrics and checkpoints.

Exactness across process counts: each TTT step's loss is a mean over the counted positions of the *global* batch
(the per-step counts are all-reduced before the loss), and each process scales its loss by the world size so that
DDP's / FSDP2's gradient averaging yields the global batch's gradient. Hence N processes with micro-batch B give the
same loss and gradients as one process with micro-batch N*B (tested on CPU with gloo).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

Strategy = Literal["ddp", "fsdp"]


def process_rank() -> int:
    """This process's rank under torchrun (``RANK``), 0 otherwise; readable before any process group exists."""
    return int(os.environ.get("RANK", "0"))


@dataclass
class Dist:
    """rank/world of this process and the device it computes on. ``owns_group``: :meth:`from_env` created the
    process group, so :meth:`close` destroys it."""

    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    strategy: Strategy = "ddp"
    owns_group: bool = field(default=False, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device: torch.device, strategy: Strategy = "ddp") -> "Dist":
        """Join the process group when started by torchrun (``WORLD_SIZE`` > 1), else a single-process context.
        On CUDA each process takes ``cuda:LOCAL_RANK``."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls(0, 1, device, strategy)
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        owns = not dist.is_initialized()
        if owns:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return cls(dist.get_rank(), dist.get_world_size(), device, strategy, owns)

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model as the loop trains it: unchanged on one process; DDP or FSDP2 (``fully_shard`` on the decoder
        layer and on the whole draft) on several."""
        if self.world == 1:
            return model
        if self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            return DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda"
                                           else None)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        mesh = init_device_mesh(self.device.type, (self.world,))
        draft = getattr(model, "draft", model)        # the loop wraps DraftWithLoss(draft)
        for layer in draft.decoder_layers():
            fully_shard(layer, mesh=mesh)
            register_fsdp_forward_method(layer, "ttt_step")   # TTT calls ttt_step, not forward
        fully_shard(model, mesh=mesh)
        return model

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over processes (in place; returned for chaining). Identity on one process."""
        if self.world > 1:
            dist.all_reduce(x)
        return x

    def model_state(self, model: nn.Module) -> dict:
        """The full (unsharded) model state dict on every process, on the CPU."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def optimizer_state(self, model: nn.Module, opt: torch.optim.Optimizer) -> dict:
        """The full optimizer state dict keyed by parameter names, on the CPU."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_states(self, model: nn.Module, opt: torch.optim.Optimizer, model_state: dict, opt_state: dict) -> None:
        """Load full states (as :meth:`model_state` / :meth:`optimizer_state` made them) into a wrapped model."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        opts = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(model, model_state, options=opts)
        set_optimizer_state_dict(model, opt, opt_state, options=opts)

    def barrier(self) -> None:
        """Wait for every process (no-op on one process)."""
        if self.world > 1:
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()

    def close(self) -> None:
        """Destroy the process group if :meth:`from_env` created it."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()

"""In-process capture with transformers: forward hooks on the aux decoder layers only.

Hooks keep just the needed layers (never the whole ``output_hidden_states`` tuple, which at long context costs
N+1 full activations); the post-norm last hidden state is the base model's ``last_hidden_state``. Equal to
transformers' own ``output_hidden_states[i + 1]`` for ``output_of_layer`` id i, and ``[-1]`` for the last state.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def _decoder_layers(model) -> torch.nn.ModuleList:
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: cannot find its decoder layers (expected model.model.layers)")
    return layers


class TransformersCapture:
    """Capture aux hidden states at ``layer_ids`` (``output_of_layer``, 0-based) and the post-norm last state.

    Usage: ``aux, last = capture(input_ids, attention_mask)`` with ``input_ids`` int64 [B, T] (right-padded) and
    ``attention_mask`` [B, T]; returns ``aux`` [B, T, L, H] and ``last`` [B, T, H] in the model's dtype.
    """

    def __init__(self, model: torch.nn.Module, layer_ids: list[int]):
        self.model = model
        self.layer_ids = list(layer_ids)
        self._captured: dict[int, torch.Tensor] = {}
        layers = _decoder_layers(model)
        self._hooks = [layers[i].register_forward_hook(self._hook(i)) for i in self.layer_ids]

    def _hook(self, i: int):
        def fn(_module, _inputs, output):
            self._captured[i] = output[0] if isinstance(output, tuple) else output
        return fn

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._captured.clear()
        base = getattr(self.model, "model", self.model)
        out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        aux = torch.stack([self._captured[i] for i in self.layer_ids], dim=2)  # [B, T, L, H]
        self._captured.clear()
        return aux, out.last_hidden_state

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


def token_budget_batches(lengths: list[int], batch_tokens: int) -> Iterator[list[int]]:
    """Group sample indices into batches of at most ``batch_tokens`` padded tokens, longest first.

    Sorting by length keeps padding small; a sample longer than the budget forms a batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batch: list[int] = []
    for i in order:
        width = lengths[batch[0]] if batch else lengths[i]
        if batch and width * (len(batch) + 1) > batch_tokens:
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch

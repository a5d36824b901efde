"""A small synchronous vLLM KV connector that writes each request's captured hidden states to one safetensors file.

vLLM's ``extract_hidden_states`` speculative method (``vllm/v1/spec_decode/extract_hidden_states.py``) runs a
cache-only "draft" layer that writes the target's hidden states at the requested layers into KV-cache slots
(``HiddenStateCacheSpec``: ``num_kv_heads`` = number of layers, ``head_size`` = H), one slot per token, in the
request's blocks. A KV connector then reads those slots when the request finishes. vLLM's stock example connector
(``distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py``) copies on a CUDA stream into pinned
memory and writes from a thread pool, which fails on CPU (``pin_memory=True requires a CUDA ... backend``,
shared/docs/VLLM_CPU.md). This one does the same job synchronously, on any device:

- scheduler side: a request that finishes keeps its blocks (``request_finished`` returns ``True``) and is handed to
  the worker with its prompt token ids and the block ids of the hidden-state group;
- worker side (TP rank 0 only: every TP rank holds the full residual stream, so one writer is correct): in the next
  engine step, :meth:`get_finished` gathers the request's rows, writes ``{req_id}.safetensors`` atomically
  (temporary name, fsync, rename) into ``shared_storage_path`` and reports the request as done, which frees its blocks.

File format (the stock connector's, so any reader of it reads ours): ``hidden_states`` [T, L, H] in the engine dtype,
rows in prompt order and layers in vLLM's order (ascending, de-duplicated layer ids); ``token_ids`` int64 [T], the
prompt token ids the engine computed. Only prompt tokens are saved (no ``include_output_tokens``); a request's
``kv_transfer_params["hidden_states_path"]`` is ignored, so files land only in the configured folder.

Because the write happens one engine step after the request finished, a caller that drives the engine in-process
must keep stepping until the file exists (:class:`eyas.capture.vllm_backend.VllmBackend` does).

Load it with ``kv_transfer_config={"kv_connector": "EyasHiddenStatesConnector", "kv_connector_module_path":
"eyas.capture.vllm_connector", "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": DIR}}``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from .vllm_backend import rows_from_blocks, write_atomic

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


@dataclass
class HiddenStateSave:
    """One finished request to write: its id, target file, prompt token ids (int64 [T]) and hidden-state blocks."""

    req_id: str
    path: str
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class HiddenStateSaveMetadata(KVConnectorMetadata):
    """Scheduler -> worker: the requests whose hidden states the worker writes in this step."""

    saves: list[HiddenStateSave] = field(default_factory=list)


def hidden_state_group_id(kv_cache_config: "KVCacheConfig | None") -> int:
    """Index of the KV-cache group whose block ids address the captured hidden states: the one
    ``HiddenStateCacheSpec`` group, or group 0 when vLLM put every layer into a single group (seen with SmolLM2 on
    vLLM-cpu 0.32: one block table serves the target's layers and the cache-only layer).

    Raises ``ValueError`` when this cannot be decided (several groups, none or several of them hidden-state groups).
    """
    if kv_cache_config is None:
        return 0
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    groups = kv_cache_config.kv_cache_groups
    ids = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
    if len(ids) == 1:
        return ids[0]
    if not ids and len(groups) == 1:
        return 0
    raise ValueError(f"cannot tell the hidden-state KV-cache group: {len(ids)} of {len(groups)} groups are; "
                     "use this connector with speculative_config method 'extract_hidden_states'")


class EyasHiddenStatesConnector(KVConnectorBase_V1, SupportsHMA):
    """Store-only KV connector for ``extract_hidden_states``: one synchronous, atomic safetensors file per request.

    Extra config (``kv_connector_extra_config``): ``shared_storage_path`` (required): the folder files are written
    to; it must exist.
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        folder = self._kv_transfer_config.get_from_extra_config("shared_storage_path", None)
        if not folder:
            raise ValueError("EyasHiddenStatesConnector needs kv_connector_extra_config.shared_storage_path")
        self.folder = str(folder)
        self.group_id = hidden_state_group_id(kv_cache_config)
        # scheduler side
        self._paths: dict[str, str] = {}
        self._to_save: list[HiddenStateSave] = []
        # worker side
        self._cache: torch.Tensor | None = None
        self._writer = True
        self._written: set[str] = set()
        self._finished: set[str] = set()

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False  # store-only: never loads

    def update_state_after_alloc(self, request: "Request", blocks, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        for new in scheduler_output.scheduled_new_reqs:
            self._paths[new.req_id] = os.path.join(self.folder, f"{new.req_id}.safetensors")
        meta = HiddenStateSaveMetadata(saves=self._to_save)
        self._to_save = []
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        path = self._paths.pop(request.request_id, None)
        if path is None or request.prompt_token_ids is None:  # aborted before it was scheduled, or embeds only
            return False, None
        self._to_save.append(HiddenStateSave(request.request_id, path, list(request.prompt_token_ids),
                                             list(block_ids)))
        return True, {"hidden_states_path": path}  # True: keep the blocks until the worker has written them

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]):
        if not 0 <= self.group_id < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self.group_id])

    def get_finished_count(self) -> int:
        return 1  # only TP rank 0 writes, so one "finished sending" per request

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        self._writer = get_tensor_model_parallel_rank() == 0
        layers = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(layers) != 1:
            raise ValueError(f"expected one cache-only hidden-state layer, found {len(layers)}")
        cache = kv_caches[layers[0]]
        # vLLM hands every layer's cache as the logical view [num_blocks, heads, block_size, head_size] whatever
        # its physical layout; for the cache-only layer heads = captured layers and head_size = H.
        n_states = len(self._vllm_config.speculative_config.draft_model_config.hf_config
                       .eagle_aux_hidden_state_layer_ids)
        hidden = self._vllm_config.model_config.get_hidden_size()
        if cache.dim() != 4 or cache.shape[1] != n_states or cache.shape[3] != hidden:
            raise ValueError(f"hidden-state cache of shape {tuple(cache.shape)}, expected [blocks, {n_states}, "
                             f"block_size, {hidden}]")
        self._cache = cache

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return None  # the cache-only layer already wrote the states; they are read in get_finished

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Write the files of the requests the scheduler handed over in this step; report those written (and
        announced finished) as done sending, which frees their blocks. Other TP ranks neither write nor report."""
        if not self._writer:
            return None, None
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, HiddenStateSaveMetadata):
                for save in meta.saves:
                    assert self._cache is not None, "register_kv_caches was not called"
                    states = rows_from_blocks(self._cache, save.block_ids, len(save.token_ids))
                    write_atomic(save.path, {"hidden_states": states,
                                             "token_ids": torch.tensor(save.token_ids, dtype=torch.long)})
                    self._written.add(save.req_id)
        # vLLM accepts "finished sending" only for ids it has announced as finished (this call or an earlier one).
        self._finished |= finished_req_ids
        done = self._written & self._finished
        self._written -= done
        self._finished -= done
        return (done or None), None

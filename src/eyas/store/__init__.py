"""The hidden-state store: safetensors shards keyed by sample id, a manifest, validation."""

from .shards import HiddenStateStore, SampleStates, StoreHeader

__all__ = ["HiddenStateStore", "SampleStates", "StoreHeader"]

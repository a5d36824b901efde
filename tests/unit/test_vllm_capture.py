"""The vLLM capture backend's parts that need no engine: layer ids in vLLM's convention, the validation of each
sample read from the connector, the connector's row gathering from the hidden-state cache, its atomic file writer,
and the target's own final norm (vLLM's last state is pre-norm; the store's is post-norm).

The engine itself runs in tests/e2e/test_extract_vllm.py."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_target as random_llama

from eyas.capture.vllm_backend import (
    VllmBackend,
    VllmCaptureError,
    check_capture,
    engine_layers,
    load_final_norm,
    make_backend,
    rows_from_blocks,
    write_atomic,
)
from eyas.config import ExtractConfig, TargetConfig
from eyas.errors import ConfigError
from eyas.records import TokenizedSample


@pytest.mark.parametrize("n, ours, engine", [
    (30, [1, 14, 26], [2, 15, 27, 30]),   # SmolLM2-135M
    (32, [1, 15, 28], [2, 16, 29, 32]),   # Llama-3.1-8B
    (61, [1, 29, 57], [2, 30, 58, 61]),   # DeepSeek-V3 / Kimi-K2 (FIELD_NOTES: hf_index [2, 30, 58])
])
def test_engine_layer_ids_are_hf_index_plus_the_last_layer(n, ours, engine):
    m = engine_layers(ours, n)
    assert m.engine_ids == engine
    assert m.aux_rows == [0, 1, 2] and m.last_row == 3


def test_engine_layer_ids_share_a_row_when_an_aux_layer_is_the_last():
    # output of layer N-1 is hf_index N, which is also where vLLM takes the (pre-norm) last state
    m = engine_layers([0, 3, 5], 6)
    assert m.engine_ids == [1, 4, 6] and m.aux_rows == [0, 1, 2] and m.last_row == 2
    with pytest.raises(ValueError, match="0..5"):
        engine_layers([0, 3, 6], 6)


def _sample(n=5):
    return TokenizedSample("conv-17", [11, 12, 13, 14, 15][:n], [1] * n)


@pytest.mark.parametrize("ids, hidden, message", [
    ([11, 12, 13, 99, 15], torch.zeros(5, 4, 7), r"conv-17: f.safetensors: .*token ids differ .*position 3"),
    ([11, 12, 13, 14], torch.zeros(4, 4, 7), r"conv-17: .*\(4 vs 5 tokens, first difference at position 4\)"),
    ([11, 12, 13, 14, 15], torch.zeros(5, 3, 7), r"conv-17: .*shape \(5, 3, 7\), expected \[T=5, L=4, H=7\]"),
    ([11, 12, 13, 14, 15], torch.zeros(5, 4, 7, dtype=torch.int32), r"conv-17: .*not floating"),
])
def test_check_capture_names_the_sample_and_the_fault(ids, hidden, message):
    with pytest.raises(VllmCaptureError, match=message):
        check_capture(_sample(), torch.tensor(ids), hidden, 4, 7, "f.safetensors")


def test_check_capture_finds_a_non_finite_value():
    h = torch.zeros(5, 4, 7, dtype=torch.bfloat16)
    h[3, 2, 6] = float("inf")
    with pytest.raises(VllmCaptureError, match=r"conv-17: .*non-finite .* = \[3, 2, 6\]"):
        check_capture(_sample(), torch.tensor([11, 12, 13, 14, 15]), h, 4, 7, "f.safetensors")


def test_rows_from_blocks_follows_the_block_table():
    blocks, L, bs, H = 6, 3, 4, 5
    cache = torch.arange(blocks * L * bs * H, dtype=torch.float32).reshape(blocks, L, bs, H)
    table, T = [4, 1, 3], 10                    # tokens 0-3 in block 4, 4-7 in block 1, 8-9 in block 3
    got = rows_from_blocks(cache, table, T)
    want = torch.stack([cache[table[t // bs], :, t % bs] for t in range(T)])  # [T, L, H]
    assert got.shape == (T, L, H) and torch.equal(got, want)
    assert got.data_ptr() != cache.data_ptr()   # a copy: the blocks are freed once the file is written
    assert torch.equal(rows_from_blocks(cache, table + [0], 8), want[:8])
    with pytest.raises(ValueError, match="need 3 blocks"):
        rows_from_blocks(cache, [4, 1], T)


def test_write_atomic_leaves_only_the_complete_file(tmp_path):
    from safetensors.torch import load_file

    path = tmp_path / "req-1.safetensors"
    t = {"hidden_states": torch.randn(3, 2, 5, dtype=torch.bfloat16), "token_ids": torch.tensor([1, 2, 3])}
    write_atomic(str(path), t)
    assert [p.name for p in tmp_path.iterdir()] == ["req-1.safetensors"]
    back = load_file(str(path))
    assert all(torch.equal(back[k], v) for k, v in t.items())


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A random Llama (hidden 36) saved as safetensors, with a non-trivial final norm weight."""
    model = random_llama(hidden=36, layers=6, heads=3, kv_heads=1, head_dim=12, vocab=99, rms_norm_eps=1e-5)
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)
    out = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(out)
    return out, model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_final_norm_is_the_targets_own(tiny_target, dtype):
    path, model = tiny_target
    norm = load_final_norm(path, dtype)
    assert type(norm).__name__ == "LlamaRMSNorm"
    ref = type(norm)(36, eps=model.config.rms_norm_eps)
    ref.load_state_dict(model.model.norm.state_dict())
    x = (torch.randn(9, 36) * 40).to(dtype)     # a pre-norm residual stream
    with torch.no_grad():
        assert torch.equal(norm(x), ref.to(dtype)(x))


def test_final_norm_turns_the_last_layer_output_into_last_hidden_state(tiny_target):
    path, model = tiny_target
    seen = {}
    hook = model.model.layers[-1].register_forward_hook(lambda m, i, o: seen.update(pre=o[0] if isinstance(o, tuple)
                                                                                    else o))
    try:
        with torch.no_grad():
            out = model.model(torch.tensor([[5, 17, 3, 98, 41]]))
    finally:
        hook.remove()
    with torch.no_grad():   # seen["pre"]: what vLLM captures at hf_index N
        torch.testing.assert_close(load_final_norm(path, torch.float32)(seen["pre"]), out.last_hidden_state)


def test_capture_settings_cannot_be_overridden(tiny_target):
    path, _ = tiny_target
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        VllmBackend(path, [0, 2, 3], engine_args={"enable_prefix_caching": True, "enforce_eager": True})


def test_torchrun_data_parallel_is_refused(tiny_target, monkeypatch):
    path, _ = tiny_target
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="torchrun"):
        make_backend(TargetConfig(model=str(path)), ExtractConfig(backend="vllm"), [0, 2, 3], None)


class ScriptedEngine:
    """What :class:`VllmBackend` relies on from vLLM's in-process ``LLMEngine`` with our connector, scripted as read
    from vLLM 0.32's source: ``add_request`` returns the id with a random suffix (``input_processor.py``
    ``assign_request_id``); a request added before a step is prefilled in it and comes back finished with the
    connector's ``kv_transfer_params`` (output ids are the caller's); the connector writes the file named after the
    suffixed id in the *next* step (``get_finished`` gets the request from the scheduler one step later).

    States written for a prompt: ``hidden[t, l, :] = token_t + l / 10 + arange(H) / 1000`` (distinct per sample,
    token and layer). ``corrupt``: request ids whose file gets other token ids."""

    def __init__(self, folder, n_states, hidden, corrupt=(), per_step=1000):
        self.folder, self.n_states, self.hidden, self.corrupt = folder, n_states, hidden, set(corrupt)
        self.per_step = per_step  # requests prefilled per step; the others wait (still running)
        self.new, self.to_write, self.aborted, self.steps = [], [], [], 0

    def add_request(self, rid, prompt, params):
        engine_id = f"{rid}-{self.steps:08x}"
        self.new.append((rid, engine_id, list(prompt["prompt_token_ids"])))
        return engine_id

    def states(self, ids):
        t = torch.tensor(ids, dtype=torch.float32)[:, None, None]
        return (t + torch.arange(self.n_states)[None, :, None] / 10
                + torch.arange(self.hidden)[None, None, :] / 1000)       # [T, L', H]

    def step(self):
        from types import SimpleNamespace

        self.steps += 1
        for rid, engine_id, ids in self.to_write:                        # the connector, one step late
            ids = [i + 1 for i in ids] if rid in self.corrupt else ids
            write_atomic(str(self.folder / f"{engine_id}.safetensors"),
                         {"hidden_states": self.states(ids), "token_ids": torch.tensor(ids)})
        finished, self.new = self.new[: self.per_step], self.new[self.per_step:]
        self.to_write = finished
        return [SimpleNamespace(request_id=rid, finished=True, outputs=[],
                                kv_transfer_params={"hidden_states_path": str(self.folder / f"{eid}.safetensors")})
                for rid, eid, _ in finished]

    def abort_request(self, rids):
        self.aborted += rids


@pytest.fixture
def scripted(tiny_target):
    path, model = tiny_target
    be = VllmBackend(path, [0, 2, 3], compute_dtype="float32", store_dtype=torch.float32)
    be._llm = ScriptedEngine(be.folder, n_states=4, hidden=36)     # engine ids [1, 3, 4, 6]: rows 0, 1, 2 + last 3
    be.max_model_len, be._params = 64, object()
    yield be, model
    be._llm = None
    be.close()


def _samples(*lengths):
    return [TokenizedSample(f"s{i}", [7 * i + k for k in range(n)], [1] * n) for i, n in enumerate(lengths)]


def test_capture_is_keyed_by_sample_id_and_waits_one_step_for_each_file(scripted):
    be, model = scripted
    eng = be._llm
    eng.add_request("warmup", {"prompt_token_ids": [1, 2, 3]}, None)  # not ours: its file must never be read
    samples = _samples(5, 9, 1)
    got = {}
    for cs in be.capture(samples):
        got[cs.sample_id] = cs
        on_disk = {p.name.split("-")[0] for p in be.folder.iterdir()}    # request ids eyas00000000{i} <-> s{i}
        assert not {f"eyas{int(sid[1:]):09d}" for sid in got} & on_disk   # each file is deleted once read
    assert sorted(got) == ["s0", "s1", "s2"]
    for s in samples:
        want = eng.states(s.input_ids)
        assert got[s.id].input_ids.tolist() == s.input_ids and got[s.id].input_ids.dtype == torch.int32
        assert torch.equal(got[s.id].aux, want[:, :3])
        with torch.no_grad():
            assert torch.equal(got[s.id].last, model.model.norm(want[:, 3]))
    assert [p.name for p in be.folder.iterdir()] == ["warmup-00000000.safetensors"]
    assert be.stats["requests"] == 3 and be.stats["tokens"] == 15 and be.stats["engine_steps"] == 2


def test_a_file_with_other_token_ids_is_refused_naming_the_sample(scripted):
    be, _ = scripted
    be._llm.corrupt = {"eyas000000001"}
    with pytest.raises(VllmCaptureError, match=r"sample s1: .*eyas000000001-.*token ids differ .*position 0"):
        list(be.capture(_samples(4, 6, 3)))


def test_an_interrupted_capture_aborts_what_is_still_running(scripted):
    be, _ = scripted
    be._llm.per_step = 1                     # step 1 prefills s0 only; s1 and s2 are still running
    gen = be.capture(_samples(4, 6, 3))
    first = next(gen)                        # step 2 writes s0's file (and prefills s1)
    gen.close()
    assert first.sample_id == "s0" and be._llm.aborted == ["eyas000000002"]


def test_a_sample_longer_than_the_engine_allows_is_named(scripted):
    be, _ = scripted                         # engine started for max_model_len 64: at most 63 prompt tokens
    with pytest.raises(VllmCaptureError, match=r"sample s1: 64 tokens, .*at most 63; set extract.vllm_engine_args"):
        list(be.capture(_samples(5, 64)))


def test_max_model_len_and_max_num_seqs_may_come_from_the_engine_args(tiny_target):
    be = VllmBackend(tiny_target[0], [0, 2, 3], engine_args={"max_model_len": 300, "max_num_seqs": 8,
                                                             "enforce_eager": True})
    try:
        assert (be.max_model_len, be.max_num_seqs, be.engine_args) == (300, 8, {"enforce_eager": True})
    finally:
        be.close()
    assert not be.folder.exists()


def test_fp8_aux_states_come_with_one_scale_per_token_and_layer(tiny_target):
    from eyas.store.fp8 import dequantize_fp8

    be = VllmBackend(tiny_target[0], [0, 2, 3], compute_dtype="float32", store_dtype=torch.bfloat16,
                     aux_format="float8_e4m3fn")
    be._llm, be.max_model_len, be._params = ScriptedEngine(be.folder, n_states=4, hidden=36), 64, object()
    try:
        (cs,) = be.capture(_samples(7))
    finally:
        be._llm = None
        be.close()
    want = ScriptedEngine(None, 4, 36).states(list(range(7)))[:, :3]           # [T, L, H]
    assert cs.aux.dtype == torch.float8_e4m3fn and cs.aux_scale.shape == (7, 3) and cs.last.dtype == torch.bfloat16
    # e4m3 keeps 3 mantissa bits: rounding moves a value by at most 2^-4 of itself
    torch.testing.assert_close(dequantize_fp8(cs.aux, cs.aux_scale, torch.float32), want, rtol=2**-4, atol=0)

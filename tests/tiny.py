"""The tests' one tiny-model factory: random, oddly sized real architectures (a Llama target, an EAGLE-3 draft),
each test choosing its own odd shape; plus the chi-square test the sampling tests share."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eyas.model.eagle3 import Eagle3Config, Eagle3DraftModel


def tiny_target(*, hidden: int = 36, intermediate: int = 70, layers: int = 6, heads: int = 3, kv_heads: int = 1,
                head_dim: int = 12, vocab: int = 99, max_positions: int = 128, seed: int = 0,
                **config) -> LlamaForCausalLM:
    """A random-weight Llama target (untied lm_head), eval mode; ``seed`` is set just before the weights are drawn;
    ``config``: more ``LlamaConfig`` fields."""
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
                      max_position_embeddings=max_positions, tie_word_embeddings=False, **config)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def draft_config(*, hidden: int = 16, intermediate: int = 23, heads: int = 4, kv_heads: int = 2, head_dim: int = 4,
                 target_hidden: int | None = None, vocab: int = 99, draft_vocab: int = 13, **fields) -> Eagle3Config:
    """An :class:`Eagle3Config`; the target is as wide as the draft unless ``target_hidden`` says otherwise."""
    return Eagle3Config(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                        num_key_value_heads=kv_heads, head_dim=head_dim, target_hidden_size=target_hidden or hidden,
                        vocab_size=vocab, draft_vocab_size=draft_vocab, **fields)


def tiny_draft(cfg: Eagle3Config | None = None, *, seed: int = 0,
               draft_ids: torch.Tensor | None = None) -> Eagle3DraftModel:
    """A random draft (``seed`` set just before the weights are drawn); with ``draft_ids`` (ascending target ids of
    the draft vocabulary) its ``d2t``/``t2d`` describe that vocabulary."""
    cfg = cfg or draft_config()
    torch.manual_seed(seed)
    m = Eagle3DraftModel(cfg)
    if draft_ids is not None:
        set_vocab(m, draft_ids)
    return m


def set_vocab(m: Eagle3DraftModel, draft_ids: torch.Tensor) -> None:
    """Give a draft the vocabulary maps of ``draft_ids`` (ascending target ids)."""
    with torch.no_grad():
        m.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        m.t2d.zero_()
        m.t2d[draft_ids] = True


# ---------------------------------------------------------------- the reference decoder's pair


def sharp_target(seed: int = 0, vocab: int = 11, sharp: float = 4.0) -> LlamaForCausalLM:
    """A 5-layer target with peaked next-token distributions (lm_head scaled by ``sharp``), so drafts get
    accepted sometimes."""
    m = tiny_target(hidden=24, intermediate=37, layers=5, heads=4, kv_heads=2, head_dim=6, vocab=vocab,
                    max_positions=256, seed=seed)
    with torch.no_grad():
        m.lm_head.weight.mul_(sharp)
    return m


def draft_for(target: LlamaForCausalLM, seed: int = 1, draft_vocab: int = 7) -> Eagle3DraftModel:
    """A random draft for :func:`sharp_target`: its embedding table, a random draft vocabulary, a sharpened head."""
    V = target.config.vocab_size
    d = tiny_draft(draft_config(hidden=24, intermediate=29, heads=4, kv_heads=2, head_dim=6, vocab=V,
                                draft_vocab=draft_vocab), seed=seed).eval()
    ids = torch.tensor(sorted(torch.randperm(V)[:draft_vocab].tolist()))
    with torch.no_grad():
        d.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        d.d2t.copy_(ids - torch.arange(draft_vocab))
        d.lm_head.weight.mul_(3.0)
    return d


def planted_accept(bad_round: int):
    """An accept rule with a planted fault: correct except in round ``bad_round`` (1-based), whose bonus token is
    the one the target ranks last (its lowest logit at that row), a token the target would not have chosen."""
    from eyas.evaluate.decoder import accept as decoder_accept

    rounds = [0]

    def rule(tree, logits, temperature, gen):
        rounds[0] += 1
        path, bonus = decoder_accept(tree, logits, temperature, gen)
        if rounds[0] == bad_round:
            row = 0 if not path else 1 + path[-1]
            bonus = int(logits[row].argmin())
        return path, bonus
    return rule


def chi2_pvalue(observed: torch.Tensor, expected_p: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled into one."""
    n = observed.sum()
    exp = expected_p * n
    small = exp < 5
    o = torch.cat([observed[~small], observed[small].sum()[None]]) if small.any() else observed
    e = torch.cat([exp[~small], exp[small].sum()[None]]) if small.any() else exp
    stat = ((o - e) ** 2 / e).sum()
    return float(torch.special.gammaincc(torch.tensor((len(o) - 1) / 2), stat / 2))


def mark_done(ctx, stage: str, summary: dict) -> None:
    """Mark ``stage`` finished in ``ctx``'s run folder with ``ctx``'s configuration (fingerprint + done.json), for a
    test that writes a stage's output itself: the next stage checks its inputs before it starts."""
    import json

    from eyas.stages import fingerprint_values, stage_fingerprint

    ctx.run.stage(stage).mkdir(parents=True, exist_ok=True)
    ctx.run.fingerprint(stage).write_text(json.dumps(stage_fingerprint(ctx.cfg, stage)))
    ctx.run.fingerprint_values(stage).write_text(json.dumps(fingerprint_values(ctx.cfg, stage)))
    ctx.run.done(stage).write_text(json.dumps({"summary": summary, "seconds": 0}))


def header_only_checkpoint(folder, tensors: dict[str, tuple[str, list[int]]], shards: int = 1) -> list:
    """Safetensors files whose headers describe ``tensors`` (name -> (safetensors dtype, shape)) and whose data is
    left as a hole (a sparse file: the apparent size is real, no disk block is written), over ``shards`` files
    (``model-0000i-of-0000N.safetensors`` with ``model.safetensors.index.json`` when more than one). For a target of
    a real large shape whose weights only the header-reading checks touch. Returns the files' paths.

    Format (safetensors README): little-endian u64 header length, the JSON header padded with spaces to a multiple
    of 8 bytes, then the tensors' bytes back to back."""
    import json
    import struct
    from pathlib import Path

    size = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8, "F8_E4M3": 1}
    names = list(tensors)
    folder = Path(folder)
    probe = folder / ".sparse-probe"
    with open(probe, "wb") as f:  # a file system without holes would write every byte: stop before that
        f.truncate(64 << 20)
    sparse = probe.stat().st_blocks * 512 < (1 << 20)
    probe.unlink()
    if not sparse:
        raise OSError(f"{folder}: this file system has no sparse files")
    files, weight_map = [], {}
    for s in range(shards):
        part = names[s::shards]
        fname = "model.safetensors" if shards == 1 else f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for n in part:
            dtype, shape = tensors[n]
            nbytes = size[dtype]
            for d in shape:
                nbytes *= d
            header[n] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[n] = fname
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        path = folder / fname
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)
        files.append(path)
    if shards > 1:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return files


def stories_extract_config(tmp_path, stories_dir, shared, *, rows: int, **extract):
    """``tmp_path/cfg.yaml``: a CPU run of stories260K on the first ``rows`` rows of the real Alpaca file, no
    generation, samples cut at 64 tokens, aux layers [0, 2, 3], 200-token extraction batches; ``extract``: more
    extract settings (``shard_bytes``, ``ignore_disk_space``, ...). Returns the config's path."""
    import yaml

    cfg = {
        "run_dir": str(tmp_path / "run"),
        "target": {"model": str(stories_dir), "dtype": "float32", "device": "cpu"},
        "prepare": {"sources": [{"path": str(shared / "data" / "train" / "alpaca_en_demo.json"),
                                 "format": "alpaca", "max_rows": rows}]},
        "generate": {"enabled": False},
        "tokenize": {"max_length": 64},
        "extract": {"layer_ids": [0, 2, 3], "batch_tokens": 200, **extract},
    }
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def stories_train_run(tmp_path, shared, *, rows: int, **train):
    """A CPU run of the stories260K llama2.c checkpoint trained online on the first ``rows`` rows of the real GSM8K
    file (no generation, samples cut at 96 tokens, a 64-id draft vocabulary, aux layers [1, 2, 3], TTT 2);
    ``train``: more train settings. Runs prepare to vocab; returns ``(ctx, logs)``, the run context (its log
    appends to ``logs``) for the test to run ``train`` on."""
    import yaml

    from eyas.config import load_config
    from eyas.stages import RunContext, init_run_dir, run_stage

    stories = shared / "models" / "stories260K"
    cfg = {"run_dir": str(tmp_path / "run"),
           "target": {"model": str(stories / "stories260K.bin"), "tokenizer": str(stories / "tok512.bin")},
           "prepare": {"sources": [{"path": str(shared / "data" / "train" / "gsm8k_train.jsonl"), "max_rows": rows}]},
           "generate": {"enabled": False}, "tokenize": {"max_length": 96}, "vocab": {"draft_vocab_size": 64},
           "extract": {"layer_ids": [1, 2, 3]},
           "train": {"mode": "online", "ttt_steps": 2, **train}}
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump(cfg))
    logs: list[str] = []
    ctx = RunContext(cfg=load_config(p), log=logs.append)
    init_run_dir(ctx, ["test"])
    for stage in ("prepare", "generate", "tokenize", "vocab"):
        run_stage(ctx, stage)
    return ctx, logs

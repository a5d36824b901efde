"""The in-process generation engine (eyas.generation.engine) and the turn scheduler (eyas.generation.inprocess).

The reference is transformers' own ``generate`` (greedy, batch 1, no padding) on tiny random models of each supported
layout: the engine must produce the same tokens and finish reasons while it refills few slots with many requests.
"""

from __future__ import annotations

import pytest
import torch

from eyas.generation.engine import GenRequest, SlotEngine, decode_attention_sdpa, unsupported_reason
from eyas.generation.inprocess import GenerateEngine, TurnScheduler
from eyas.records import Conversation, Message

EOS = 7


def _model(kind: str, seed: int = 0):
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
           "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[kind]
    cfg = cls[0](hidden_size=48, intermediate_size=97, num_hidden_layers=3, num_attention_heads=6,
                 num_key_value_heads=2, head_dim=8, vocab_size=101, max_position_embeddings=256,
                 tie_word_embeddings=False, eos_token_id=EOS)
    torch.manual_seed(seed)
    return cls[1](cfg).eval()


def _reference(model, prompts, max_new):
    out = []
    for p in prompts:
        ids = model.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False, eos_token_id=EOS,
                             pad_token_id=0)[0, len(p):].tolist()
        out.append(ids)
    return out


def _run(engine, prompts, max_new):
    queue = [GenRequest(i, p, max_new) for i, p in enumerate(prompts)]
    got = {}

    def feed(n):
        take = queue[:n]
        del queue[:n]
        return take

    engine.run(feed, lambda r: got.__setitem__(r.key, r))
    return [got[i] for i in range(len(prompts))]


def _prompts(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8, 101, (n,), generator=g).tolist() for n in [5, 17, 1, 40, 9, 23, 3, 31]]


def _frequent_token(model, prompts, max_new):
    """A token the model emits mid-reply for some prompts: used as the end id, so replies end both ways."""
    from collections import Counter

    outs = [model.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p) + 2:].tolist() for p in prompts]
    return Counter(t for o in outs for t in set(o)).most_common(1)[0][0]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_slot_engine_equals_transformers_generate(kind):
    model = _model(kind)
    prompts = _prompts()
    eos = _frequent_token(model, prompts, 24)
    ref = [model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=eos,
                          pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    engine = SlotEngine(model, slots=3, cache_len=80, max_new_tokens=24, eos_ids=[eos], steps_per_graph=4)
    results = _run(engine, prompts, 24)
    for r, want in zip(results, ref):
        full = r.token_ids + ([r.stop_token] if r.stop_token is not None else [])
        assert full == want
        assert r.finish == ("stop" if want[-1] == eos else "length")
        assert eos not in r.token_ids
    assert {r.finish for r in results} == {"stop", "length"}
    assert engine.stats.requests == len(prompts)
    assert engine.stats.new_tokens == sum(len(w) for w in ref)
    assert engine.stats.prefill_tokens == sum(len(p) for p in prompts)


def test_limits_follow_the_cache_and_each_request():
    model = _model("llama")
    prompts = _prompts()
    engine = SlotEngine(model, slots=2, cache_len=45, max_new_tokens=30, eos_ids=[])
    reqs = [GenRequest(i, p, 3 + i) for i, p in enumerate(prompts)]
    got = {}
    engine.run(lambda n: [reqs.pop(0) for _ in range(min(n, len(reqs)))], lambda r: got.__setitem__(r.key, r))
    for i, p in enumerate(_prompts()):
        assert len(got[i].token_ids) == min(3 + i, 45 - len(p))   # the 40-token prompt gets 5 new tokens
        assert got[i].finish == "length"
    ref = _reference(model, [_prompts()[3]], 5)[0]
    assert got[3].token_ids == ref
    with pytest.raises(ValueError, match="does not fit"):
        SlotEngine(model, slots=2, cache_len=10, max_new_tokens=4, eos_ids=[]).run(
            lambda n, r=[GenRequest(0, list(range(8, 20)), 4)]: [r.pop()] if r else [], lambda r: None)


def test_sampling_with_a_tiny_top_p_is_greedy():
    model = _model("llama")
    prompts = _prompts()
    greedy = _run(SlotEngine(model, slots=3, cache_len=80, max_new_tokens=12, eos_ids=[EOS]), prompts, 12)
    sampled = _run(SlotEngine(model, slots=3, cache_len=80, max_new_tokens=12, eos_ids=[EOS], temperature=0.8,
                              top_p=1e-6, seed=3), prompts, 12)
    assert [r.token_ids for r in sampled] == [r.token_ids for r in greedy]
    free = _run(SlotEngine(model, slots=3, cache_len=80, max_new_tokens=12, eos_ids=[EOS], temperature=5.0,
                           seed=3), prompts, 12)
    assert [r.token_ids for r in free] != [r.token_ids for r in greedy]


def test_generate_engine_fallback_equals_reference():
    model = _model("qwen2")
    prompts = _prompts()
    ref = _reference(model, prompts, 16)
    results = _run(GenerateEngine(model, batch_size=3, eos_ids=[EOS], pad_id=0, temperature=0.0, top_p=1.0,
                                  seed=0), prompts, 16)
    assert [r.token_ids + ([r.stop_token] if r.stop_token is not None else []) for r in results] == ref


def test_decode_attention_reads_only_each_rows_keys():
    g = torch.Generator().manual_seed(0)
    B, nh, nkv, L, hd = 5, 6, 2, 33, 8
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64) for s in [(B, nh, hd), (B, nkv, L, hd),
                                                                           (B, nkv, L, hd)])
    klen = torch.tensor([1, 7, 33, 12, 20])
    got = decode_attention_sdpa(q, k, v, klen)
    for b in range(B):
        for h in range(nh):
            kk, vv = k[b, h // (nh // nkv), : klen[b]], v[b, h // (nh // nkv), : klen[b]]
            w = torch.softmax(kk @ q[b, h] / hd ** 0.5, 0)
            torch.testing.assert_close(got[b, h], w @ vv)


def test_unsupported_models_are_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    assert "gpt2" in unsupported_reason(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2)))
    assert unsupported_reason(_model("llama")) is None


def test_turn_scheduler_runs_turns_in_order_and_finishes_conversations_first(stories_dir):
    """Multi-turn conversations: turn i is prompted with the replies regenerated before it, rendered by the
    target's template; a due follow-up turn is served before a new conversation; each finished conversation is
    handed over at once, with its replies' exact token ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eyas.data.chat import render_prompt

    tok = AutoTokenizer.from_pretrained(stories_dir)
    model = AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32).eval()
    convs = [Conversation(f"c{i}", [Message("user", f"Once upon a time {i}"), Message("assistant", "old"),
                                    Message("user", "Then what?"), Message("assistant", "old"),
                                    Message("user", "The end.")] if i % 3 == 0 else
                          [Message("user", f"A cat named {i}")]) for i in range(7)]
    done: list[Conversation] = []
    sched = TurnScheduler(tok, convs, max_new_tokens=10, max_prompt_tokens=None, chat_template_kwargs={},
                          on_conversation=done.append)
    engine = SlotEngine(model, slots=2, cache_len=200, max_new_tokens=10, eos_ids=[tok.eos_token_id])
    prompts_seen = []
    feed = sched.feed

    def spy(n):
        reqs = feed(n)
        prompts_seen.extend((r.key.conv.id, len(r.key.replies), list(r.prompt_ids)) for r in reqs)
        return reqs

    engine.run(spy, sched.on_result)
    assert sorted(c.id for c in done) == sorted(c.id for c in convs)
    by_id = {c.id: c for c in done}
    for c in convs:
        got = by_id[c.id]
        assert [m.role for m in got.messages] == ["user", "assistant"] * sum(m.role == "user" for m in c.messages)
        assert all(m.content != "old" for m in got.messages)
        for m in got.messages:
            if m.role == "assistant":
                assert m.token_ids is not None and tok.decode(m.token_ids, skip_special_tokens=False).lstrip() == m.content.lstrip()   # noqa: E501 (decoded in context: a leading space kept)
    # the second turn's prompt is the template's render of turn 1 with its regenerated reply
    c0 = by_id["c0"]
    want = render_prompt(tok, [m.to_dict() for m in c0.messages[:3]])
    second = next(p for cid, t, p in prompts_seen if cid == "c0" and t == 1)
    assert second == tok(want, add_special_tokens=False).input_ids
    # multi-turn conversations started first, and their follow-ups went before the single-turn ones left
    assert [cid for cid, t, _ in prompts_seen[:2]] == ["c0", "c3"]
    order = [(cid, t) for cid, t, _ in prompts_seen]
    assert order.index(("c0", 2)) < order.index(("c6", 0))
    assert sched.finish["stop"] + sched.finish["length"] == 3 * 3 + 4


def test_harmony_replies_are_stored_as_the_template_renders_them():
    """gpt-oss emits its analysis and final channels as special-token text; the stored reply is the final answer
    with the analysis as reasoning (issue 12: it was stored as 'analysisUser wants...assistantfinalBlue.')."""
    from eyas.data.chat import split_harmony

    raw = ("<|channel|>analysis<|message|>User wants a colour. Pick blue.<|end|><|start|>assistant"
           "<|channel|>final<|message|>Blue.")
    assert split_harmony(raw) == ("Blue.", "User wants a colour. Pick blue.")
    assert split_harmony("<|channel|>final<|message|>Blue.") == ("Blue.", None)
    assert split_harmony("Blue.") is None
    assert split_harmony("<|channel|>commentary to=functions.x<|message|>{}") is None      # tool calls: verbatim


def test_a_reply_that_does_not_tokenize_back_is_trained_as_emitted(stories_dir):
    """Compared in context, as training sees the reply: a SentencePiece tokenizer marks a word start ('▁"') on
    a text tokenized alone, not on the same reply inside the rendering, so only a real non-canonical split differs;
    that reply's emitted ids replace its text's tokens (mask 1), and everything around it stays as rendered."""
    from transformers import AutoTokenizer

    from eyas.data.chat import render_conversation
    from eyas.stages.tokenize import with_emitted_tokens

    tok = AutoTokenizer.from_pretrained(stories_dir)
    msgs = [Message("user", "hi"), Message("assistant", '"\nOnce upon a time'), Message("user", "more"),
            Message("assistant", "time"), Message("user", "end")]
    r = render_conversation(tok, [m.to_json() for m in msgs])
    spans = {i: (a, b) for i, a, b in r.reply_tokens}
    first = r.input_ids[slice(*spans[1])]                          # in context: what the target emits
    assert first != tok(msgs[1].content, add_special_tokens=False).input_ids   # alone: a word-start mark added
    split = [t for ch in "time" for t in tok(ch, add_special_tokens=False).input_ids]   # not how "time" tokenizes
    assert split != r.input_ids[slice(*spans[3])]
    msgs[1] = Message("assistant", msgs[1].content, token_ids=first)
    msgs[3] = Message("assistant", "time", token_ids=split)
    ids, mask, spliced = with_emitted_tokens(msgs, r)
    a, b = spans[3]
    assert spliced == [3]
    assert ids == r.input_ids[:a] + split + r.input_ids[b:]
    assert mask == r.loss_mask[:a] + [1] * len(split) + r.loss_mask[b:]


def test_replies_are_decoded_in_context(stories_dir):
    """A SentencePiece reply that starts with a space token keeps the space (decoded after the prompt's last ids,
    as servers detokenize), so its text tokenizes back, in the rendered conversation, to the ids emitted."""
    from transformers import AutoTokenizer

    from eyas.generation.inprocess import decode_in_context

    tok = AutoTokenizer.from_pretrained(stories_dir)
    prompt = tok("Tom said hi.", add_special_tokens=False).input_ids
    reply = tok.convert_tokens_to_ids(["\u2581", "J", "am", "es"])
    assert tok.decode(reply, skip_special_tokens=False) == "James"            # alone: the space is lost
    assert decode_in_context(tok, prompt[-8:], reply) == " James"
    assert decode_in_context(tok, [], reply) == "James"                       # no prompt: as decoded alone

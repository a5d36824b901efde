"""generate.backend 'openai' without a server: reading replies in vLLM's response shape, and a server that is not
there (a clear error; finished work stays). The real-server tests are in tests/e2e/test_generate_vllm.py."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion
from vllm_server import free_port

from eyas.config import RunConfig, SourceConfig
from eyas.data.formats import load_source
from eyas.generation.openai_chat import ServerError, reply_from_choice
from eyas.io import iter_jsonl
from eyas.records import SkipCounter
from eyas.stages import RunContext, run_stage
from tiny import mark_done


def _completion(message: dict, finish_reason: str, **choice) -> ChatCompletion:
    # The body vLLM 0.32 returns (vllm/entrypoints/openai/chat_completion/protocol.py), parsed by the openai client.
    return ChatCompletion.model_validate({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish_reason,
                     "logprobs": None, **choice}],
    })


def test_reply_keeps_how_it_ended():
    """Issue 19: the finish reason goes with the reply, and vLLM's ``stop_reason`` as the stop token when it is a
    token id (None for the model's EOS, a string for a stop string: no token to name)."""
    cases = [(("length", None), ("length", None)), (("stop", None), ("stop", None)), (("stop", 7), ("stop", 7)),
             (("stop", "</answer>"), ("stop", None)), (("tool_calls", None), ("stop", None))]
    for (finish, stop_reason), want in cases:
        r = reply_from_choice(_completion({"content": "x"}, finish, stop_reason=stop_reason).choices[0])
        assert (r.finish_reason, r.stop_token) == want, (finish, stop_reason)


def test_reply_keeps_reasoning_from_vllm_and_older_servers():
    # Content and reasoning exactly as returned (issue 12, kind 3): whitespace is tokens the target emitted; the
    # template decides what it renders of them (Qwen3 strips the newlines around its think block itself).
    new = _completion({"content": "\n\nThe answer is 4.", "reasoning": " 2 + 2 = 4 \n"}, "stop")
    r = reply_from_choice(new.choices[0])
    assert (r.content, r.reasoning, r.finish_reason) == ("\n\nThe answer is 4.", " 2 + 2 = 4 \n", "stop")
    inline = _completion({"content": "<think>\nAdd.\n</think>\n\nFour. "}, "stop")   # no reasoning parser
    assert (reply_from_choice(inline.choices[0]).content, reply_from_choice(inline.choices[0]).reasoning) == (
        "<think>\nAdd.\n</think>\n\nFour. ", None)
    old = _completion({"content": "Four", "reasoning_content": "add them"}, "length")
    r = reply_from_choice(old.choices[0])
    assert (r.content, r.reasoning, r.finish_reason) == ("Four", "add them", "length")
    plain = _completion({"content": None}, "stop")
    r = reply_from_choice(plain.choices[0])
    assert (r.content, r.reasoning) == ("", None)


def test_unreachable_server_is_a_clear_error_and_keeps_finished_work(shared, tmp_path):
    src = SourceConfig(path=str(shared / "data" / "train" / "gsm8k_train.jsonl"), max_rows=3)
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    cfg = RunConfig.model_validate({
        "run_dir": str(tmp_path / "run"),
        "target": {"model": "not-loaded-by-the-openai-backend"},
        "prepare": {"sources": [src.model_dump()]},
        "generate": {"backend": "openai", "openai": {"base_url": url, "max_retries": 0, "timeout_s": 5}},
    })
    ctx = RunContext(cfg=cfg, log=lambda m: None)
    # what prepare writes, without loading a tokenizer for its report
    convs = [c.to_json() for c in load_source(src, SkipCounter(), {})]
    ctx.run.stage("prepare").mkdir(parents=True)
    (ctx.run.prepared).write_text("".join(json.dumps(c) + "\n" for c in convs))
    mark_done(ctx, "prepare", {"samples": len(convs), "duplicates": 0, "skipped": 0, "tokens": 0})
    first = convs[0]
    out = ctx.run.generated
    out.parent.mkdir(parents=True)
    out.write_text(json.dumps(first) + "\n")  # finished by an earlier run
    with pytest.raises(ServerError, match=url.replace(".", r"\.")):
        run_stage(ctx, "generate")
    assert [d for _, d in iter_jsonl(out)] == [first]
    assert not (ctx.run.done("generate")).exists()


def test_requests_keep_special_tokens_the_target_emits():
    # vLLM's and SGLang's chat endpoints drop special tokens from the reply text unless asked not to.
    from eyas.config import GenerateConfig
    from eyas.generation.openai_chat import OpenAIChatGenerator

    g = OpenAIChatGenerator(GenerateConfig(), {"enable_thinking": True})
    body = g.request([{"role": "user", "content": "Hi"}], seed=None)["extra_body"]
    assert body == {"skip_special_tokens": False, "chat_template_kwargs": {"enable_thinking": True}}
    g = OpenAIChatGenerator(GenerateConfig(openai={"extra_body": {"skip_special_tokens": True, "top_k": 5}}))
    assert g.request([{"role": "user", "content": "Hi"}])["extra_body"] == {"skip_special_tokens": True, "top_k": 5}

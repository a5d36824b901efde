"""Regenerate assistant turns through an OpenAI-compatible chat server (vLLM, SGLang) that serves the target.

The server renders each request with the target's own chat template (the one it serves with), so the replies are
exactly what users of that server get. ``chat_template_kwargs`` (e.g. ``enable_thinking``) go with every request
in ``extra_body``, as vLLM's and SGLang's chat endpoints accept them.

Contract
--------
- One conversation = its system turn (if any) and its user turns; the assistant turns are regenerated turn by turn:
  turn k is asked with ``[system], u1, a1', ..., uk`` where ``ai'`` are the replies generated before it (the
  dataset's own assistant turns are never sent).
- Sampling: ``temperature``, ``top_p``, ``max_tokens = generate.max_new_tokens``; with temperature > 0 each request
  carries a seed derived from ``generate.seed``, the sample id and the turn, so a re-run asks the same question the
  same way (vLLM honours per-request seeds).
- A reply's ``content`` is kept exactly as the server returns it (no stripping: a reply's leading or trailing
  whitespace is tokens the target emitted), with its finish reason (``Message.finish_reason``: ``"length"`` for a
  reply cut at ``max_tokens``, which tokenize trains without an end-of-turn token) and, where the server names it,
  the stop token id; its reasoning text (vLLM >= 0.10 ``message.reasoning``, older vLLM and
  SGLang ``message.reasoning_content``; present only when the server runs a reasoning parser) is kept, as returned,
  as :attr:`eyas.records.Message.reasoning_content`; without a parser the reasoning stays inline in the content
  (``<think>...</think>``), which tokenize renders as the target's template does. Every request asks for
  ``skip_special_tokens: false`` (vLLM's and SGLang's default is true, which deletes special tokens the target
  emits inside a reply, such as a tool-call marker); ``openai.extra_body`` can override it.
- Bounded concurrency: at most ``openai.concurrency`` conversations are in flight; turns of one conversation are
  sequential (each needs the previous reply).
- Retries and time-outs come from the ``openai`` client itself: ``max_retries`` retries of connection errors,
  time-outs, 408, 409, 429 and 5xx with exponential back-off and jitter (0.5 s doubling to 8 s; openai-python
  ``_base_client.py``), ``timeout_s`` per request.
- ``generate.max_prompt_tokens``, as in the in-process backend: a turn whose prompt (rendered locally with the
  target's tokenizer and template) has at least that many tokens is not asked; the conversation ends before it
  (its first turn: kept as a prompt without reply, which tokenize skips) and is counted.
- Errors: a 400 answer about one conversation (usually prompt + max_tokens over the server's ``max-model-len``) is
  that sample's problem: its first turn failing skips it, a later turn failing keeps the turns done so far; both
  are counted with the server's message. Anything else (server unreachable after the retries, wrong model name,
  authentication) is :class:`~eyas.errors.EyasError`; conversations finished before it stay written.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import GenerateConfig
from ..errors import EyasError
from ..io import stable_hash
from ..records import Conversation, Message, SkipRecord

__all__ = ["ServerError", "ChatReply", "ConversationResult", "OpenAIChatGenerator", "generate_conversations",
           "reply_from_choice"]


class ServerError(EyasError):
    """The server cannot be used: unreachable after the retries, unknown model, refused credentials."""


@dataclass
class ChatReply:
    """One generated assistant turn. ``finish_reason``: ``"stop"`` (end-of-turn/stop token) or ``"length"``
    (``max_tokens`` reached), as the server reports it; ``stop_token``: the token id it stopped on when the server
    names one (vLLM's ``stop_reason`` for a stop token other than the model's EOS), else ``None``."""

    content: str
    reasoning: str | None
    finish_reason: str
    stop_token: int | None = None


@dataclass
class ConversationResult:
    """A regenerated conversation (``None`` when its first turn failed) and what went wrong on the way."""

    conversation: Conversation | None
    finish_reasons: list[str] = field(default_factory=list)
    skips: list[SkipRecord] = field(default_factory=list)
    over_max_prompt_tokens: int = 0  # 1 when a turn was not asked because of generate.max_prompt_tokens


def user_skeleton(conv: Conversation) -> list[Message]:
    """The turns that are sent: system and user turns in order (the dataset's assistant turns are dropped)."""
    return [m for m in conv.messages if m.role != "assistant"]


class OpenAIChatGenerator:
    """An async client for one OpenAI-compatible server; see the module docstring for the contract.

    Args:
        gen: the generate section (sampling settings and ``gen.openai`` for the server).
        chat_template_kwargs: passed to the server's chat template with every request (``tokenize`` section).
        prompt_tokens: counts the tokens of a rendered prompt (messages -> int); needed for
            ``gen.max_prompt_tokens``.
    """

    def __init__(self, gen: GenerateConfig, chat_template_kwargs: dict | None = None,
                 prompt_tokens: Callable[[list[dict]], int] | None = None):
        from openai import AsyncOpenAI

        self.gen = gen
        self.srv = gen.openai
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.client = AsyncOpenAI(
            base_url=self.srv.base_url,
            api_key=os.environ.get(self.srv.api_key_env) or "EMPTY",  # vLLM without --api-key accepts any key
            timeout=self.srv.timeout_s,
            max_retries=self.srv.max_retries,
        )
        self.model: str | None = self.srv.model
        self.prompt_tokens = prompt_tokens
        if gen.max_prompt_tokens and prompt_tokens is None:
            raise ValueError("generate.max_prompt_tokens needs prompt_tokens (the target tokenizer's count)")

    async def resolve_model(self) -> str:
        """The served model name: ``openai.model``, or the server's only model. Raises :class:`ServerError`."""
        import openai

        try:
            served = [m.id for m in (await self.client.models.list()).data]
        except openai.APIError as e:
            raise ServerError(f"generate.openai.base_url {self.srv.base_url}: cannot list models ({e}); is the server "
                              f"running and reachable?") from None
        if self.model is None:
            if len(served) != 1:
                raise ServerError(f"{self.srv.base_url} serves {served}: set generate.openai.model to the target")
            self.model = served[0]
        elif self.model not in served:
            raise ServerError(f"generate.openai.model '{self.model}' is not served by {self.srv.base_url} "
                              f"(it serves {served})")
        return self.model

    def _request_seed(self, sample_id: str, turn: int) -> int | None:
        if self.gen.temperature <= 0:
            return None
        return int(stable_hash([self.gen.seed, sample_id, turn], n=8), 16) & 0x7FFFFFFF

    def request(self, messages: list[dict], seed: int | None = None) -> dict:
        """The keyword arguments of one chat-completion request (see the module docstring)."""
        extra = {"skip_special_tokens": False, **self.srv.extra_body}
        if self.chat_template_kwargs:
            extra["chat_template_kwargs"] = {**self.chat_template_kwargs, **extra.get("chat_template_kwargs", {})}
        kwargs = dict(model=self.model, messages=messages, temperature=self.gen.temperature,
                      top_p=self.gen.top_p, max_tokens=self.gen.max_new_tokens, n=1, extra_body=extra)
        if seed is not None:
            kwargs["seed"] = seed
        return kwargs

    async def reply(self, messages: list[dict], seed: int | None = None) -> ChatReply:
        """Ask the server for the next assistant turn after ``messages`` (OpenAI chat format).

        Raises ``openai.BadRequestError`` for a request the server refuses (e.g. too long) and :class:`ServerError`
        for every other failure left after the client's retries.
        """
        import openai

        try:
            resp = await self.client.chat.completions.create(**self.request(messages, seed))
        except openai.BadRequestError:
            raise
        except (openai.APIConnectionError, openai.APITimeoutError) as e:
            raise ServerError(f"{self.srv.base_url}: no answer after {self.srv.max_retries} retries ({e})") from None
        except openai.APIStatusError as e:
            raise ServerError(f"{self.srv.base_url}: HTTP {e.status_code}: {e.message}") from None
        return reply_from_choice(resp.choices[0])

    async def regenerate(self, conv: Conversation) -> ConversationResult:
        """Regenerate every assistant turn of ``conv`` turn by turn; see the module docstring for failures."""
        import openai

        skel = user_skeleton(conv)
        history: list[dict] = []
        out: list[Message] = []
        result = ConversationResult(None)
        turn = 0
        for m in skel:
            history.append({"role": m.role, "content": m.content})
            out.append(m)
            if m.role != "user":
                continue
            if self.gen.max_prompt_tokens and self.prompt_tokens(history) >= self.gen.max_prompt_tokens:
                result.over_max_prompt_tokens = 1
                if turn > 0:
                    out.pop()  # a later user turn without a reply is dropped; the first one is kept as a prompt
                break
            try:
                r = await self.reply(history, self._request_seed(conv.id, turn))
            except openai.BadRequestError as e:
                where = conv.source or conv.id
                msg = _short(e)
                if turn == 0:
                    result.skips.append(SkipRecord(where, f"server refused the first turn: {msg}", "messages"))
                    return result
                out.pop()  # the user turn without a reply
                result.skips.append(SkipRecord(where, f"turns from user turn {turn} on dropped, server refused: "
                                                      f"{msg}", "messages"))
                break
            reply = Message("assistant", r.content, r.reasoning, finish_reason=r.finish_reason,
                            stop_token=r.stop_token)
            # Earlier replies go back as plain content, as a chat client sends them; the template decides what it
            # renders of earlier turns (Qwen3 drops their reasoning anyway).
            history.append({"role": "assistant", "content": r.content})
            out.append(reply)
            result.finish_reasons.append(r.finish_reason)
            turn += 1
        result.conversation = Conversation(id=conv.id, messages=out, source=conv.source)
        return result


def reply_from_choice(choice) -> ChatReply:
    """Read one ``openai`` ``Choice`` of a chat completion into a :class:`ChatReply`.

    The reasoning text is vLLM's ``message.reasoning`` (vLLM >= 0.10; vllm/entrypoints/openai/chat_completion/
    protocol.py ``ChatMessage``) or ``message.reasoning_content`` (older vLLM, SGLang, DeepSeek's API): fields the
    ``openai`` client keeps in ``model_extra``. Both are kept as returned (whitespace included); an absent or empty
    reasoning is ``None``. ``finish_reason`` is ``"length"`` when the server says so, else ``"stop"``; the stop
    token is vLLM's ``stop_reason`` when it is a token id (vllm/entrypoints/openai/chat_completion/protocol.py
    ``ChatCompletionResponseChoice``: ``None`` for the model's EOS token, a string for a stop string).
    """
    msg = choice.message
    extra = msg.model_extra or {}
    reasoning = extra.get("reasoning") or extra.get("reasoning_content")
    finish = "length" if choice.finish_reason == "length" else "stop"
    stop_reason = (choice.model_extra or {}).get("stop_reason")
    return ChatReply(
        content=msg.content or "",
        reasoning=reasoning if isinstance(reasoning, str) and reasoning else None,
        finish_reason=finish,
        stop_token=stop_reason if finish == "stop" and type(stop_reason) is int else None,
    )


def _short(e: Exception, n: int = 200) -> str:
    body = getattr(e, "body", None)
    msg = body.get("message") if isinstance(body, dict) else None
    return str(msg or getattr(e, "message", None) or e)[:n]


async def generate_conversations(
    gen: GenerateConfig,
    todo: list[Conversation],
    on_result: Callable[[ConversationResult], None],
    chat_template_kwargs: dict | None = None,
    prompt_tokens: Callable[[list[dict]], int] | None = None,
) -> str:
    """Regenerate ``todo`` with at most ``gen.openai.concurrency`` conversations in flight.

    ``on_result`` is called (in the event loop, one at a time) as each conversation finishes, so the caller can
    append it durably at once. Returns the served model name. Raises :class:`ServerError` (after cancelling the
    conversations in flight) when the server cannot be used; results already passed to ``on_result`` stay.
    """
    g = OpenAIChatGenerator(gen, chat_template_kwargs, prompt_tokens)
    model = await g.resolve_model()
    queue: asyncio.Queue[Conversation] = asyncio.Queue()
    for c in todo:
        queue.put_nowait(c)

    async def worker() -> None:
        while True:
            try:
                c = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            on_result(await g.regenerate(c))

    tasks = [asyncio.create_task(worker()) for _ in range(min(gen.openai.concurrency, max(1, len(todo))))]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await g.client.close()
    return model

"""Regenerate conversations in-process, turn by turn, on top of a generation engine (the generate stage's
``transformers`` backend).

Each conversation is reduced to its skeleton (system and user turns); turn i is prompted with the skeleton up to user
turn i and the replies regenerated so far, rendered with the target's own chat template (the prompt a server would
prefill). The :class:`TurnScheduler` hands prompts to the engine as slots free up: the next turn of a conversation in
flight goes before any new conversation, so conversations finish early and are written (``on_conversation``, which
the stage appends and fsyncs) as soon as their last turn returns; an interrupted run keeps every finished one.
Conversations with the most user turns start first, so the long multi-turn ones do not form the tail of the run.

A reply is kept exactly as the target produced it: its token ids (without the end-of-turn token) are stored with the
message (``Message.token_ids``) with how it ended (``finish_reason``: ``"stop"``, with the ``stop_token`` it ended
on, or ``"length"``, cut at ``max_new_tokens``), and its text is their decoding with special tokens kept and no
whitespace stripped, so nothing the target emits (harmony channels, reasoning markers) is dropped or changed; a
gpt-oss (harmony) reply is stored as its final answer with its analysis as ``reasoning_content``, the form its
template renders (:func:`eyas.data.chat.split_harmony`).

Engines: :class:`eyas.generation.engine.SlotEngine` (continuous batching, CUDA graphs; Llama/Qwen layouts) or, for
other models, :class:`GenerateEngine`, which calls ``model.generate`` on batches of ready prompts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..data.chat import render_prompt, split_harmony
from ..records import Conversation, Message
from .engine import EngineStats, GenRequest, GenResult


CONTEXT_TOKENS = 8


def decode_in_context(tok, prompt_tail: Sequence[int], ids: Sequence[int]) -> str:
    """The text of ``ids`` as they continue ``prompt_tail`` (special tokens kept): ``decode(tail + ids)`` less
    ``decode(tail)``, as servers detokenize incrementally. Decoding ``ids`` alone drops what a SentencePiece
    tokenizer reads as a word-start mark (a reply's leading space, '▁'), and that text would no longer tokenize
    back to the ids the target emitted. Falls back to ``decode(ids)`` when the prompt's text is not a prefix."""
    head = tok.decode(list(prompt_tail), skip_special_tokens=False)
    full = tok.decode(list(prompt_tail) + list(ids), skip_special_tokens=False)
    if prompt_tail and full.startswith(head):
        return full[len(head):]
    return tok.decode(list(ids), skip_special_tokens=False)


@dataclass
class _Turns:
    """A conversation being regenerated: its skeleton (no assistant turns) and the replies so far."""

    conv: Conversation
    skeleton: list[Message]
    n_users: int
    replies: list[Message] = field(default_factory=list)
    prompt_tail: list[int] = field(default_factory=list)   # the last ids of the turn being generated's prompt

    def prompt_messages(self) -> list[dict]:
        """The messages of the next turn's prompt: the skeleton up to user turn ``len(replies)``, each earlier user
        turn followed by its regenerated reply."""
        turn, users, out = len(self.replies), 0, []
        for m in self.skeleton:
            if m.role == "user":
                if users > turn:
                    break
                out.append(m.to_dict())
                if users < turn:
                    out.append(self.replies[users].to_dict())
                users += 1
            else:
                out.append(m.to_dict())
        return out

    def finished(self) -> Conversation:
        """The regenerated conversation: every user turn that got a reply, followed by it. A conversation whose
        first prompt was over the limit keeps its first user turn alone (tokenize skips it and counts it)."""
        msgs, r = [], 0
        for m in self.skeleton:
            if m.role == "user" and r == len(self.replies) and r > 0:
                break
            msgs.append(m)
            if m.role == "user":
                if r == len(self.replies):
                    break
                msgs.append(self.replies[r])
                r += 1
        return Conversation(id=self.conv.id, messages=msgs, source=self.conv.source)


class TurnScheduler:
    """Feeds turn prompts to an engine (``feed``) and folds its results back into conversations (``on_result``).

    Args:
        tokenizer: the target's tokenizer (chat template).
        convs: conversations to regenerate.
        max_new_tokens: reply limit of every turn.
        max_prompt_tokens: a turn whose prompt has at least this many tokens is not generated and its conversation
            ends before it (counted in ``over_limit``); ``None``: no limit.
        chat_template_kwargs: template variables (``tokenize.chat_template_kwargs``), as tokenize renders.
        on_conversation: called with each finished :class:`Conversation`.
    """

    def __init__(self, tokenizer, convs: Sequence[Conversation], *, max_new_tokens: int,
                 max_prompt_tokens: int | None, chat_template_kwargs: dict,
                 on_conversation: Callable[[Conversation], None]):
        self.tok, self.kwargs = tokenizer, dict(chat_template_kwargs)
        self.max_new, self.max_prompt = max_new_tokens, max_prompt_tokens
        self.on_conversation = on_conversation
        states = []
        for c in convs:
            skel = [m for m in c.messages if m.role != "assistant"]
            states.append(_Turns(c, skel, sum(m.role == "user" for m in skel)))
        states.sort(key=lambda s: -s.n_users)       # stable: the rest keep the dataset's order
        self.new: deque[_Turns] = deque(states)
        self.follow_ups: deque[_Turns] = deque()    # conversations whose next turn is due (served first)
        self.finish = {"stop": 0, "length": 0}
        self.over_limit = 0
        self.conversations = 0
        self.prompt_tokens = 0

    def _encode(self, states: list[_Turns]) -> list[list[int]]:
        texts = [render_prompt(self.tok, s.prompt_messages(), chat_template_kwargs=self.kwargs,
                               sample_id=s.conv.id) for s in states]
        return self.tok(texts, add_special_tokens=False).input_ids if texts else []

    def feed(self, n: int) -> list[GenRequest]:
        """Up to ``n`` ready prompts: due follow-up turns first, then new conversations (encoded in one batch)."""
        out: list[GenRequest] = []
        while len(out) < n and (self.follow_ups or self.new):
            take = []
            while len(take) < n - len(out) and self.follow_ups:
                take.append(self.follow_ups.popleft())
            while len(take) < n - len(out) and self.new:
                s = self.new.popleft()
                if s.n_users == 0:
                    self._done(s)   # nothing to prompt (prepare keeps none of these; defensive)
                    continue
                take.append(s)
            for s, ids in zip(take, self._encode(take)):
                if self.max_prompt and len(ids) >= self.max_prompt:
                    self.over_limit += 1
                    self._done(s)
                    continue
                self.prompt_tokens += len(ids)
                s.prompt_tail = list(ids[-CONTEXT_TOKENS:])
                out.append(GenRequest(s, ids, self.max_new))
        return out

    def on_result(self, res: GenResult) -> None:
        """Store the reply; queue the conversation's next turn or hand the finished conversation on."""
        s: _Turns = res.key
        text = decode_in_context(self.tok, s.prompt_tail, res.token_ids)
        harmony = split_harmony(text)             # gpt-oss: reasoning and final answer, as its template takes them
        content, reasoning = harmony if harmony is not None else (text, None)
        s.replies.append(Message("assistant", content, reasoning_content=reasoning, token_ids=list(res.token_ids),
                                 finish_reason=res.finish, stop_token=res.stop_token))
        self.finish[res.finish] += 1
        if len(s.replies) < s.n_users:
            self.follow_ups.append(s)
        else:
            self._done(s)

    def _done(self, s: _Turns) -> None:
        self.conversations += 1
        self.on_conversation(s.finished())


class GenerateEngine:
    """The fallback engine: ``model.generate`` on batches of up to ``batch_size`` ready prompts (left-padded),
    for models :class:`~eyas.generation.engine.SlotEngine` does not cover. Same ``run(feed, on_result)`` contract."""

    def __init__(self, model, *, batch_size: int, eos_ids: Sequence[int], pad_id: int, temperature: float,
                 top_p: float, seed: int):
        self.model, self.batch_size = model, batch_size
        self.eos = set(int(e) for e in eos_ids)
        self.pad_id, self.temperature, self.top_p, self.seed = pad_id, temperature, top_p, seed
        self.stats = EngineStats(attention="transformers generate", slots=batch_size)

    @torch.no_grad()
    def run(self, feed: Callable[[int], list[GenRequest]], on_result: Callable[[GenResult], None]) -> EngineStats:
        import time

        t0 = time.time()
        dev = self.model.get_input_embeddings().weight.device
        while reqs := feed(self.batch_size):
            T = max(len(r.prompt_ids) for r in reqs)
            ids = torch.full((len(reqs), T), self.pad_id, dtype=torch.long)
            mask = torch.zeros(len(reqs), T, dtype=torch.long)
            for i, r in enumerate(reqs):
                ids[i, T - len(r.prompt_ids):] = torch.as_tensor(list(r.prompt_ids))
                mask[i, T - len(r.prompt_ids):] = 1
            kw = dict(max_new_tokens=max(r.max_new_tokens for r in reqs), pad_token_id=self.pad_id,
                      eos_token_id=sorted(self.eos) or None)
            if self.temperature > 0:
                torch.manual_seed(self.seed + self.stats.requests)
                kw.update(do_sample=True, temperature=self.temperature, top_p=self.top_p)
            else:
                kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
            new = self.model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), **kw)[:, T:].tolist()
            self.stats.requests += len(reqs)
            self.stats.prefill_tokens += sum(len(r.prompt_ids) for r in reqs)
            for r, row in zip(reqs, new):
                row = row[: r.max_new_tokens]
                end = next((j for j, t in enumerate(row) if t in self.eos), None)
                self.stats.new_tokens += len(row) if end is None else end + 1
                if end is None:
                    on_result(GenResult(r.key, row, "length", None))
                else:
                    on_result(GenResult(r.key, row[:end], "stop", row[end]))
        self.stats.seconds += time.time() - t0
        return self.stats


def end_of_turn_ids(model, tokenizer) -> list[int]:
    """The ids that end a reply: the model's ``generation_config.eos_token_id`` (one or a list) and the tokenizer's
    ``eos_token_id`` (what transformers' ``generate`` and the engines stop on)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(int(i) for i in ids)


def make_engine(model, tokenizer, cfg, *, prompt_limit: int, log: Callable[[str], None] = print):
    """The engine for ``generate`` (a :class:`~eyas.config.GenerateConfig`): :class:`SlotEngine` when
    ``generate.engine`` allows it and the model is supported, else :class:`GenerateEngine` (saying why).

    ``prompt_limit``: the longest prompt, in tokens, a turn may have (the engine's cache holds it plus
    ``max_new_tokens``). Slots (``generate.batch_size``; default 1,024 on a GPU, 16 on the CPU) are lowered to what
    the GPU's free memory holds."""
    from .engine import SlotEngine, unsupported_reason

    eos = end_of_turn_ids(model, tokenizer)
    dev = model.get_input_embeddings().weight.device
    slots = cfg.batch_size or (1024 if dev.type == "cuda" else 16)
    why = "generate.engine is 'generate'" if cfg.engine == "generate" else unsupported_reason(model)
    if why is None:
        return SlotEngine(model, slots=slots, cache_len=prompt_limit + cfg.max_new_tokens,
                          max_new_tokens=cfg.max_new_tokens, eos_ids=eos, temperature=cfg.temperature,
                          top_p=cfg.top_p, seed=cfg.seed, log=log)
    if cfg.engine == "slots":
        from ..errors import ConfigError

        raise ConfigError(f"generate.engine: 'slots' cannot run this target: {why}")
    log(f"[eyas] generate: transformers' generate in batches of {slots} ({why})")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    return GenerateEngine(model, batch_size=slots, eos_ids=eos, pad_id=pad, temperature=cfg.temperature,
                          top_p=cfg.top_p, seed=cfg.seed)

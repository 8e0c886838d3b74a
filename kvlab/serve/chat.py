"""Chat with a real language model whose K/V live in kvlab's paged pool, and watch the cache work.

A chat turn is two phases over one :class:`~kvlab.Sequence`:

1. **prefill**: the prompt (system message, earlier turns, your question, rendered by the model's chat template)
   goes through :meth:`Llama.step <kvlab.serve.model.Llama.step>` in one batch. Its K/V fill blocks of the pool; full
   blocks are registered in the prefix cache. A later prompt that starts with the same tokens (the same system
   prompt, the conversation so far) gets those blocks back at ``manager.create``: ``prefix_hit_tokens`` of its
   prompt are never recomputed.
2. **decode**: one token at a time. :func:`sample` picks it from the logits (greedy, or temperature and top-p
   with a seeded generator); the model appends its K/V (a new block every ``block_size`` tokens) until the
   end-of-turn token or ``max_new_tokens``.

``n > 1`` forks the sequence after prefill: the answers share the prompt's blocks, and the first token each
appends into the shared, partly filled last block copies that block first (copy-on-write).

>>> import kvlab
>>> session = kvlab.ChatSession(kvlab.load_model("smollm2-135m"), system="You are a helpful assistant.")
>>> session.ask("What is the capital of France?").text
'The capital of France is Paris.'
>>> session.ask("What is the capital of Germany?").prefix_hit_tokens   # one block of the shared start was cached
16
>>> print(session.report())                                           # blocks used / cached / free, hits
>>> for step in session.stream("And of Italy?"):                       # token by token (ask is built on it)
...     print(step.text)


Every figure is measured: ``ttft_s`` and ``decode_tokens_per_s`` are wall seconds (``time.perf_counter``).
Bad arguments raise :class:`~kvlab.ConfigError` before anything changes; a pool too small for an answer raises
:class:`~kvlab.OutOfBlocksError` once the call has freed everything it took.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlab.core.checks import check_flag, check_positive, check_seed, check_token_ids
from kvlab.core.errors import ConfigError, OutOfBlocksError
from kvlab.core.events import Event
from kvlab.serve.model import Llama
from kvlab.serve.sampling import check_temperature, check_top_p, sample
from kvlab.core.pool import BlockPool
from kvlab.core.sequence import CopiedOnWrite, Sequence, SequenceManager

#: What ``on_token`` is called with as each token of the (first) answer arrives: its index in the answer, its
#: id, and the answer's text so far.
OnToken = Callable[[int, int, str], object]


@dataclass
class ChatReply:
    """One answered request. ``text``/``tokens``/``finish_reason`` are the first answer's; ``texts``,
    ``all_tokens`` and ``finish_reasons`` hold all ``n``. ``tokens`` are the generated ids, end-of-turn excluded;
    ``finish_reason`` is ``"stop"`` (the model ended its turn) or ``"length"`` (``max_new_tokens`` reached).

    Cache figures: ``prompt_tokens`` in the prompt, ``prefix_hit_tokens`` of them served by the prefix cache (not
    recomputed), ``blocks_used`` distinct blocks the request held at its peak (forks share), ``cow_copies``
    blocks copied on write. Timing (wall seconds): ``ttft_s`` from the call to the first token,
    ``decode_tokens_per_s`` the tokens generated after the first step (all answers) over their seconds (0.0 when
    there are none)."""
    text: str
    texts: list[str]
    tokens: list[int]
    all_tokens: list[list[int]]
    finish_reason: str
    finish_reasons: list[str]
    prompt_tokens: int
    prefix_hit_tokens: int
    blocks_used: int
    cow_copies: int
    ttft_s: float
    decode_tokens_per_s: float


@dataclass(frozen=True)
class ChatStep:
    """What a streamed request looks like after one decode step (``step`` 0: the first token, sampled from the
    prefill's logits). ``new_tokens[j]`` is the token answer ``j`` got at this step (None once it has ended),
    ``all_tokens[j]`` its tokens so far, ``tables[j]`` its sequence's block table now (empty once it has ended:
    its blocks are released). ``prefix_hit_tokens`` of the ``prompt_tokens`` came from the prefix cache (the
    leading ``prefix_hit_tokens // block_size`` entries of every table); ``cow_copies`` blocks were copied on
    write so far. ``texts`` decodes the tokens (empty strings for a model without a tokenizer)."""
    step: int
    new_tokens: tuple[int | None, ...]
    all_tokens: tuple[tuple[int, ...], ...]
    tables: tuple[tuple[int, ...], ...]
    prompt_tokens: int
    prefix_hit_tokens: int
    cow_copies: int
    tokenizer: Any = field(default=None, repr=False, compare=False)

    @property
    def texts(self) -> list[str]:
        tok = self.tokenizer
        return [tok.decode(list(t)) if tok is not None else "" for t in self.all_tokens]

    @property
    def text(self) -> str:
        """The first answer's text so far."""
        return self.tokenizer.decode(list(self.all_tokens[0])) if self.tokenizer is not None else ""


class ChatStream:
    """One request answered token by token: iterate it for a :class:`ChatStep` after each decode step;
    ``reply`` is the :class:`ChatReply` once the iteration ends (None before). :meth:`close` abandons the request
    (its blocks are freed; ``reply`` stays None); so does an exception raised where it is iterated, or dropping
    the stream. Made by :meth:`ChatSession.stream`; :meth:`ChatSession.ask` and :meth:`~ChatSession.complete`
    run one to the end."""

    def __init__(self, steps: Generator[ChatStep, None, ChatReply], done: Callable[[ChatReply], None]) -> None:
        self._steps, self._done = steps, done
        self.reply: ChatReply | None = None

    def __iter__(self) -> Iterator[ChatStep]:
        return self

    def __next__(self) -> ChatStep:
        try:
            return next(self._steps)
        except StopIteration as end:
            if self.reply is None and end.value is not None:
                self.reply = end.value
                self._done(end.value)
            raise StopIteration from None

    def close(self) -> None:
        """Abandon the request if it is still going (its blocks are freed)."""
        self._steps.close()

    def run(self, on_token: OnToken | None = None) -> ChatReply:
        """Answer to the end; ``on_token(i, token_id, text_so_far)`` sees the first answer's tokens."""
        try:
            for step in self:
                t = step.new_tokens[0]
                if on_token is not None and t is not None:
                    on_token(len(step.all_tokens[0]) - 1, t, step.text)
        finally:
            self.close()
        if self.reply is None:
            raise ConfigError("this stream was closed before its answer was complete")
        return self.reply


class ChatSession:
    """A chat with ``model`` (a :class:`~kvlab.serve.model.Llama`; :func:`kvlab.load_model` gives one with a tokenizer)
    over its own pool of ``num_blocks`` blocks of ``block_size`` tokens (``.pool``) and a
    :class:`~kvlab.SequenceManager` (``.manager``) with a prefix cache unless ``prefix_cache=False``. ``system``
    starts every prompt (None: the template's own default, if it has one). ``turns`` keeps the conversation
    (user and assistant messages) that ``ask(..., history=True)`` puts in front of the next question."""

    def __init__(self, model: Llama, *, num_blocks: int = 1024, block_size: int = 16, system: str | None = None,
                 prefix_cache: bool = True) -> None:
        if not isinstance(model, Llama):
            raise ConfigError(f"ChatSession needs a kvlab Llama (kvlab.load_model or kvlab.TinyLlama), got {model!r}")
        if system is not None and not isinstance(system, str):
            raise ConfigError(f"system must be a str or None, got {system!r:.80}")
        prefix_cache = check_flag(prefix_cache, "prefix_cache")
        self.model, self.system = model, system
        self.pool = BlockPool(num_blocks, spec=model.cfg.kv_spec(block_size, model.dtype, model.device))
        self.manager = SequenceManager(self.pool, prefix_cache=prefix_cache)
        self.turns: list[dict[str, str]] = []
        self.totals = dict.fromkeys(("requests", "prompt_tokens", "prefix_hit_tokens", "generated_tokens",
                                     "peak_blocks"), 0)

    def __repr__(self) -> str:
        return f"ChatSession({self.model.cfg.name!r}, {self.pool!r}, {len(self.turns) // 2} turns)"

    # ------------------------------------------------------------------ asking
    def ask(self, prompt: str, *, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
            seed: int | None = None, n: int = 1, history: bool = False, on_token: OnToken | None = None
            ) -> ChatReply:
        """Answer ``prompt`` (see the module docstring). The prompt is the system message, the earlier
        ``turns`` when ``history`` is True, then ``prompt``, through the model's chat template. ``n`` answers are
        sampled in one batch from a fork of the prompt's sequence; ``on_token(i, token_id, text_so_far)`` sees
        the first answer's tokens as they arrive. The turn (question and first answer) is added to ``turns``."""
        t0 = time.perf_counter()
        if not isinstance(prompt, str):
            raise ConfigError(f"prompt must be a str, got {prompt!r:.80}")
        args = self._check(max_new_tokens, temperature, top_p, seed, n, on_token)
        return self._stream(prompt, t0, history, *args[:-1]).run(on_token)

    def complete(self, prompt_ids: Seq[int], *, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, n: int = 1, on_token: OnToken | None = None
                 ) -> ChatReply:
        """What :meth:`ask` does after the chat template: continue the token ids ``prompt_ids`` as they are. Works
        for a model without a tokenizer (:class:`~kvlab.TinyLlama`: no end-of-turn token, its texts are empty)."""
        t0 = time.perf_counter()
        ids = check_token_ids(prompt_ids, "prompt_ids", self.model.cfg.vocab_size)
        args = self._check(max_new_tokens, temperature, top_p, seed, n, on_token)
        return self._stream(ids, t0, False, *args[:-1]).run(on_token)

    def stream(self, prompt: str | Seq[int], *, max_new_tokens: int = 128, temperature: float = 0.0,
               top_p: float = 1.0, seed: int | None = None, n: int = 1, history: bool = False) -> ChatStream:
        """Answer ``prompt`` token by token: a :class:`ChatStream` to iterate (one :class:`ChatStep` after each
        decode step), with the reply in ``.reply`` at the end. A str is a chat message, as :meth:`ask` takes it
        (the turn is added to ``turns`` when the answer is complete); token ids are continued as they are, as
        :meth:`complete` does. Everything is checked here: a bad argument raises :class:`ConfigError` now, and
        nothing runs until the stream is iterated."""
        t0 = time.perf_counter()
        if not isinstance(prompt, str):
            prompt = check_token_ids(prompt, "prompt", self.model.cfg.vocab_size)
        return self._stream(prompt, t0, history, *self._check(max_new_tokens, temperature, top_p, seed, n, None)[:-1])

    def _stream(self, prompt: str | list[int], t0: float, history: Any, max_new_tokens: int, temperature: float,
                top_p: float, seed: int | None, n: int) -> ChatStream:
        history = check_flag(history, "history")
        if not isinstance(prompt, str):
            self._fits(len(prompt), max_new_tokens)
            return ChatStream(self._steps(prompt, t0, max_new_tokens, temperature, top_p, seed, n), lambda r: None)
        tok = self.model.tokenizer
        if tok is None:
            raise ConfigError(f"{self.model.cfg.name} has no tokenizer: give token ids to complete() instead")
        messages = [{"role": "system", "content": self.system}] if self.system is not None else []
        messages += self.turns if history else []
        ids = check_token_ids(tok.chat([*messages, {"role": "user", "content": prompt}]), "prompt",
                              self.model.cfg.vocab_size)
        self._fits(len(ids), max_new_tokens)

        def done(reply: ChatReply) -> None:
            self.turns += [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply.text}]
        return ChatStream(self._steps(ids, t0, max_new_tokens, temperature, top_p, seed, n), done)

    def _check(self, max_new_tokens: Any, temperature: Any, top_p: Any, seed: Any, n: Any, on_token: Any
               ) -> tuple[int, float, float, int | None, int, OnToken | None]:
        if on_token is not None and not callable(on_token):
            raise ConfigError(f"on_token must be None or a function (i, token_id, text_so_far), got {on_token!r}")
        return (check_positive(max_new_tokens, "max_new_tokens"), check_temperature(temperature),
                check_top_p(top_p), check_seed(seed, optional=True), check_positive(n, "n"), on_token)

    def _fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        context = self.model.cfg.context_len
        if prompt_tokens + max_new_tokens > context:
            raise ConfigError(f"the prompt ({prompt_tokens} tokens) plus max_new_tokens={max_new_tokens} is longer "
                              f"than {self.model.cfg.name}'s context of {context} tokens")

    def _steps(self, ids: list[int], t0: float, max_new_tokens: int, temperature: float, top_p: float,
               seed: int | None, n: int) -> Generator[ChatStep, None, ChatReply]:
        """The one path of every request: prefill, fork, then decode, yielding a :class:`ChatStep` after each
        step; returns the :class:`ChatReply`. Its ``finally`` frees the request however it ends (closed too)."""
        model, manager = self.model, self.manager
        tok = model.tokenizer
        eos = tok.eos_id if tok is not None else None
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        cows: list[Event] = []
        unsubscribe = self.pool.events.subscribe(lambda e: cows.append(e) if isinstance(e, CopiedOnWrite) else None)
        seqs: list[Sequence] = []
        out: list[list[int]] = [[] for _ in range(n)]
        finish = ["length"] * n
        peak = hit = 0
        t_first = t_last = 0.0
        later = 0  # tokens of the steps after the first

        def held() -> int:
            return len({b for s in seqs if s.alive for b in s.block_table})

        try:
            seqs.append(manager.create(ids))
            hit = seqs[0].num_cached_tokens
            logits = model.step(manager, seqs, [ids[hit:]])  # prefill: the part the prefix cache did not hold
            seqs += [seqs[0].fork() for _ in range(n - 1)]
            logits, live = logits.expand(n, -1), list(range(n))
            for step in range(max_new_tokens):
                peak = max(peak, held())
                now_tokens = sample(logits, temperature, top_p, generator)
                now = time.perf_counter()
                if step == 0:
                    t_first = now
                going = []
                new: list[int | None] = [None] * n
                for j, t in zip(live, now_tokens):
                    if t == eos:
                        finish[j] = "stop"
                        manager.free(seqs[j])  # its full blocks stay cached
                        continue
                    out[j].append(t)
                    new[j] = t
                    going.append(j)
                    if step:
                        later, t_last = later + 1, now
                live = going
                yield ChatStep(step, tuple(new), tuple(map(tuple, out)),
                               tuple(tuple(s.block_table) if s.alive else () for s in seqs), len(ids), hit, len(cows),
                               tok)
                if not live or step == max_new_tokens - 1:
                    break
                logits = model.step(manager, [seqs[j] for j in live], [[out[j][-1]] for j in live])
        except OutOfBlocksError as e:
            raise OutOfBlocksError(
                f"the pool ({self.pool.num_blocks} blocks of {self.pool.block_size} tokens) ran out during a "
                f"{len(ids)}-token prompt and {max(map(len, out))} generated tokens: {e} (use a larger num_blocks, "
                f"or fewer max_new_tokens or n)") from e
        finally:
            unsubscribe()
            for s in seqs:
                if s.alive:
                    manager.free(s)
        texts = [tok.decode(o) if tok is not None else "" for o in out]
        rate = later / (t_last - t_first) if later and t_last > t_first else 0.0
        reply = ChatReply(texts[0], texts, out[0], out, finish[0], finish, len(ids), hit, peak, len(cows),
                          t_first - t0, rate)
        for key, value in (("requests", 1), ("prompt_tokens", len(ids)), ("prefix_hit_tokens", hit),
                           ("generated_tokens", sum(map(len, out)))):
            self.totals[key] += value
        self.totals["peak_blocks"] = max(self.totals["peak_blocks"], peak)
        return reply

    # ------------------------------------------------------------------ reporting
    def usage(self) -> dict[str, Any]:
        """The pool now (``blocks``, ``used``: held by a live request, ``cached``: kept for prefix hits, ``free``),
        the prefix cache's counters (``prefix_*``, from :meth:`PrefixCache.get_stats`) and the session's totals."""
        pool, cache = self.pool, self.manager.prefix_cache
        free, cached = pool.num_free_blocks, pool.num_cached_blocks
        stats = cache.get_stats() if cache is not None else {}
        return {"blocks": pool.num_blocks, "used": pool.num_blocks - free - cached, "cached": cached, "free": free,
                **{f"prefix_{k}": v for k, v in stats.items() if k in ("queries", "hits", "hit_rate")},
                **self.totals}

    def report(self) -> str:
        """The pool's blocks and the prefix cache's hits, as text."""
        u, s = self.usage(), self.pool.spec
        mib = self.pool.bytes_per_block / 2**20
        lines = [f"pool: {u['blocks']} blocks x {s.block_size} tokens, {mib:.2f} MiB each ({s.num_layers} layers x "
                 f"{s.num_kv_heads} KV heads x {s.head_dim} dims, {str(s.dtype).removeprefix('torch.')} on "
                 f"{s.device})",
                 f"blocks now: {u['used']} used, {u['cached']} cached (kept for prefix hits), {u['free']} free",
                 f"requests: {u['requests']}, {u['prompt_tokens']} prompt tokens, {u['generated_tokens']} generated; "
                 f"at most {u['peak_blocks']} blocks held by one request"]
        if self.manager.prefix_cache is None:
            lines.append("prefix cache: off")
        else:
            lines.append(f"prefix cache: {u['prefix_hits']} of {u['prefix_queries']} full prompt blocks looked up "
                         f"were hits ({u['prefix_hit_rate']:.0%}): {u['prefix_hit_tokens']} prompt tokens not "
                         "recomputed")
        return "\n".join(lines)

"""ChatView: chat with a real model and watch its KV cache fill, share, fork and evict (all of §2.2 at once).

``ChatView(session)`` shows a :class:`~kvlab.ChatSession` as a text box and a Send button beside the session's
pool. While an answer streams in, token by token, the pool grid (the :class:`~kvlab.viz.PoolView` panel: state
colours, refcounts, flashes) fills block by block, and each live request's block table is listed under the
answer. A table entry is drawn in the colour of its grid cell; entries the prefix cache served are marked
"prefix hit", entries with two or more references "shared", and a block copied on write "copied". Under every
turn, one status line counts what happened, from the pool's events: prompt tokens served by the cache (not
recomputed), blocks copied on write when ``n > 1`` answers fork, cached blocks evicted to make room.

>>> view = kvlab.ChatView(kvlab.ChatSession(model, num_blocks=64, system="You are a helpful assistant."))
>>> view                                    # type a question and press Send: the kernel stays responsive
>>> view.ask("What is the capital of France?")          # or from a cell (a notebook run headless records it)
>>> view.ask("And of Germany?", n=2, temperature=0.8)  # prefix hits, then a fork and one copy-on-write

How it runs. A Send click starts the turn as an asyncio task on the kernel's loop (as a LiveRun does): the task
takes one token of :meth:`ChatSession.stream <kvlab.ChatSession.stream>` (the same path ``ask`` uses), then yields
to the loop, so clicks and later cells run between two tokens; a click handler that generated the whole answer
itself would hold the kernel until the answer ended. :meth:`ChatView.ask` runs the turn in the calling cell.

Frames. After every token the view builds one frame (:mod:`kvlab.viz.frames`) whose JSON tail also carries the
conversation so far with its status lines (``tail["chat"]``) and the answers' block tables (``tail["tables"]``, made
by :class:`~kvlab.viz.tables.BlockTables`, as a :class:`~kvlab.viz.BlockTableView` draws them): ``recording`` keeps
every one, so ``ChatView(recording=...)``, ``BlockTableView(recording=...)``, ``PoolView(recording=...)`` and
:meth:`ChatView.export_html` replay the chat token by token; ``BlockTableView(view)`` draws each frame this view
shows as it shows it. The browser gets them paced (at most ``fps`` a second, the latest, and always the last of a
turn), since unpaced sends are dropped by the server's iopub rate limit. The display bundle's PNG
(:func:`plot_chat`) shows the latest pool and answer where no JavaScript runs.
"""
from __future__ import annotations

import asyncio
import textwrap
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import traitlets

from kvlab.serve.chat import ChatReply, ChatSession, ChatStep, ChatStream
from kvlab.serve.sampling import check_temperature
from kvlab.core.checks import check_flag, check_positive
from kvlab.core.errors import ConfigError
from kvlab.core.events import Event, Evicted
from kvlab.core.sequence import CopiedOnWrite
from kvlab.viz.export import export_html
from kvlab.viz.frames import Frame, FrameBuilder, frame_of
from kvlab.viz.live import Pacer, Recording
from kvlab.viz.static import Picture, as_frame, draw_pool, legend
from kvlab.viz.tables import BlockTables, Row, frame_tables
from kvlab.viz.views import FrameView

MAX_ANSWERS = 8  # answers per turn the view offers: each is a fork listed with its block table


def status_line(turn: dict[str, Any]) -> str:
    """What a turn did, in words: prefix hits, copies on write, evictions, tokens generated."""
    parts = [f"提示 {turn['prompt_tokens']} 个 token，其中 {turn['hit_tokens']} 个来自缓存、不重算 "
             "(prompt tokens, from cache)"]
    if turn["answers_n"] > 1 or turn["cow"]:
        parts.append(f"分叉出 {turn['answers_n']} 个回答，{turn['cow']} 个块写时复制 (forked, copied on write)")
    parts.append(f"淘汰了 {turn['evicted']} 个缓存块 (evicted)")
    if turn["error"]:
        parts.append(turn["error"])
    elif turn["live"]:
        each = "（所有回答合计）" if turn["answers_n"] > 1 else ""
        parts.append(f"回答中：已生成 {turn['generated']} 个 token{each} (answering)")
    else:
        parts.append(f"共生成 {turn['generated']} 个 token（{', '.join(turn['finish'])}）(generated)")
    return " · ".join(parts)


class ChatView(FrameView):
    """A chat box beside the session's pool: Send streams the answer while the grid and the block tables fill.

    ``session`` is a :class:`~kvlab.ChatSession` (or give ``recording=`` frames of an earlier ChatView to replay
    them). ``n`` answers and ``temperature`` are the Send button's defaults (the browser's boxes change them);
    ``max_new_tokens`` bounds every answer; ``history`` puts the conversation so far in front of each question,
    so a second turn hits the cache for the whole first one."""

    view = "chat"
    busy = traitlets.Bool(False).tag(sync=True)  # a turn is being answered
    interactive = traitlets.Bool(False).tag(sync=True)  # a session to send to (False: a replay)
    n = traitlets.Int(1).tag(sync=True)
    temperature = traitlets.Float(0.0).tag(sync=True)
    message = traitlets.Unicode("").tag(sync=True)  # why the last Send was refused ("" if it was not)

    def __init__(self, session: ChatSession | None = None, *, n: int = 1, temperature: float = 0.0,
                 max_new_tokens: int = 64, history: bool = True, fps: float = 30.0,
                 recording: Recording | Iterable[bytes] | None = None, **kwargs: Any) -> None:
        if (session is None) == (recording is None):
            raise ConfigError(f"a ChatView shows a ChatSession or replays a recording, got {session!r:.80} and "
                              f"recording={recording!r:.80}")
        if session is not None and not isinstance(session, ChatSession):
            raise ConfigError(f"a ChatView shows a kvlab.ChatSession, not {session!r:.80}")
        history = check_flag(history, "history")
        check_answers(n)
        check_temperature(temperature)
        self.session, self.history_turns = session, history
        self.max_new_tokens = check_positive(max_new_tokens, "max_new_tokens")
        self.pacer = Pacer(fps)
        self.recording = Recording()  # every frame built, one per token (the browser gets them paced)
        self.turns: list[dict[str, Any]] = []
        self.tables: list[list[int]] = []  # the block tables of the latest request (its last step's)
        self.block_tables: BlockTables | None = None  # the latest turn's, for the frames' tail["tables"]
        self.mirrors: list[FrameView] = []  # views shown every frame this one shows (a BlockTableView)
        self.task: asyncio.Task[ChatReply | None] | None = None
        self._turn: dict[str, Any] = {}
        super().__init__(None if session is None else session.pool, recording=recording,
                         interactive=session is not None, n=n, temperature=temperature, **kwargs)

    @traitlets.validate("n", "temperature")
    def _valid(self, proposal: dict[str, Any]) -> Any:
        """A bad default is refused before it is stored (the view stays as it was)."""
        if proposal["trait"].name == "temperature":
            return check_temperature(proposal["value"])
        return check_answers(proposal["value"])

    # ------------------------------------------------------------------ frames
    def chat_state(self) -> dict[str, Any]:
        """What a frame's ``tail["chat"]`` holds: every turn (prompt, answers, status) and whether one is being
        answered. The latest request's block tables go in ``tail["tables"]`` (:meth:`table_rows`)."""
        return {"turns": [{k: t[k] for k in ("prompt", "answers", "status", "live")} for t in self.turns],
                "answering": bool(self._turn.get("live"))}

    def table_rows(self) -> list[Row]:
        """The latest request's block tables as rows (one per answer, empty once it ended) for
        :class:`~kvlab.viz.tables.BlockTables`: the first ``hit_blocks`` entries of each came from the prefix
        cache."""
        hits, n = self._turn.get("hit_blocks", 0), len(self.tables)
        return [(j, "请求 request" if n == 1 else f"回答 {j + 1} answer", table, hits)
                for j, table in enumerate(self.tables)]

    def update(self) -> None:
        """Send the pool's current state with the conversation (no flashes)."""
        if self.session is None:
            raise ConfigError("this ChatView replays a recording and has no pool to update from")
        tables = {} if self.block_tables is None else self.block_tables.tail()
        self._emit(frame_of(self.session.pool, chat=self.chat_state(), **tables), force=True)

    def _emit(self, frame: Frame, force: bool = False) -> None:
        """Record the frame; send it if one is due (or ``force``)."""
        self.recording.append(frame.data)
        if force or self.pacer.due():
            self.pacer.mark()
            for view in (self, *self.mirrors):
                view.show_frame(frame)

    def export_html(self, path: str | Path, title: str = "kvlab chat") -> Path:
        """The recorded chat as one standalone HTML replay (:func:`kvlab.viz.export_html`)."""
        return export_html(self.recording if len(self.recording) else self.history, path, view="chat", title=title)

    # ------------------------------------------------------------------ a turn
    def _open(self, prompt: Any, n: Any, temperature: Any, seed: Any) -> tuple[ChatStream, Any, int, float]:
        """Check everything and open the turn's stream (it runs when iterated); the view is not touched."""
        if self.session is None:
            raise ConfigError("this ChatView replays a recording: there is no session to ask")
        if self.busy:
            raise ConfigError("a turn is being answered: wait for it (or stop it) before sending another")
        if isinstance(prompt, str) and not prompt.strip():
            raise ConfigError(f"the prompt is empty: {prompt!r}")
        n = check_answers(self.n if n is None else n)
        temperature = check_temperature(self.temperature if temperature is None else temperature)
        stream = self.session.stream(prompt, max_new_tokens=self.max_new_tokens, temperature=temperature, seed=seed,
                                     n=n, history=self.history_turns)
        return stream, prompt, n, temperature

    def _begin(self, stream: ChatStream, prompt: Any, n: int, temperature: float) -> ChatStream:
        """Start the turn: a new entry in the conversation, the pool's events counted, the question's frame."""
        assert self.session is not None  # checked by _open
        shown = prompt if isinstance(prompt, str) else "token ids " + " ".join(map(str, prompt))
        self._turn = {"prompt": shown, "answers": [""] * n, "status": "reading the prompt", "live": True,
                      "answers_n": n, "prompt_tokens": 0, "hit_tokens": 0, "hit_blocks": 0, "cow": 0,
                      "evicted": 0, "generated": 0, "finish": [], "error": ""}
        self.turns.append(self._turn)
        self.tables = []
        self.n, self.temperature, self.message, self.busy = n, temperature, "", True
        self._builder = FrameBuilder(self.session.pool)
        # the turn's copies on write are marked afresh: a block id copied in an earlier turn may be reused
        self.block_tables = BlockTables(self.table_rows, pool=self.session.pool)
        self._builder.tail_sources.append(self.block_tables.tail)
        self._unsubscribe = self.session.pool.events.subscribe(self._on_event)
        self._emit(self._builder.frame(chat=self.chat_state()), force=True)
        return stream

    def _on_event(self, e: Event) -> None:
        if isinstance(e, Evicted):
            self._turn["evicted"] += 1
        elif isinstance(e, CopiedOnWrite):
            self._turn["cow"] += 1

    def _step(self, step: ChatStep) -> None:
        """One token: the answers, the tables and the status line, then a frame (sent if one is due)."""
        t, block = self._turn, self.session.pool.block_size if self.session is not None else 1
        t["answers"] = [text or " ".join(map(str, ids)) for text, ids in zip(step.texts, step.all_tokens)]
        t["prompt_tokens"], t["hit_tokens"] = step.prompt_tokens, step.prefix_hit_tokens
        t["hit_blocks"], t["generated"] = step.prefix_hit_tokens // block, sum(map(len, step.all_tokens))
        if any(step.tables):  # at the end every answer has released its blocks: keep the last tables shown
            self.tables = [list(table) for table in step.tables]
        t["status"] = status_line(t)
        self._emit(self._builder.frame(chat=self.chat_state()))

    def _end(self, reply: ChatReply | None, error: BaseException | None) -> None:
        """The turn is over (answered, stopped or failed): its last frame, always sent."""
        t = self._turn
        self._unsubscribe()
        t["live"] = False
        if reply is not None:
            t["finish"] = reply.finish_reasons
            t["generated"] = sum(map(len, reply.all_tokens))
        elif isinstance(error, (asyncio.CancelledError, KeyboardInterrupt)):
            t["error"] = "stopped before the end (its blocks were released)"
        elif error is not None:
            t["error"] = f"failed: {error}"
        t["status"] = status_line(t)
        try:
            if error is not None:  # a pool call stopped half-way publishes no event for what it had changed
                self._builder.resync()
            self._emit(self._builder.frame(chat=self.chat_state()), force=True)
            self._builder.close()
            if self.block_tables is not None:
                self.block_tables.close()
            for view in (self, *self.mirrors):
                view.refresh_if_unwatched()
        finally:  # after the last frame: the front end shows the final status before it offers Send again
            self.busy = False

    def ask(self, prompt: str | list[int], *, n: int | None = None, temperature: float | None = None,
            seed: int | None = None) -> ChatReply:
        """Answer ``prompt`` in this cell (a str for a model with a tokenizer, else token ids), recording a frame
        per token and sending them paced; returns the :class:`~kvlab.ChatReply`. ``n`` and ``temperature`` default
        to the view's."""
        stream = self._begin(*self._open(prompt, n, temperature, seed))
        try:
            for step in stream:
                self._step(step)
        except BaseException as e:
            stream.close()
            self._end(None, e)
            raise
        assert stream.reply is not None
        self._end(stream.reply, None)
        return stream.reply

    def submit(self, prompt: str | list[int], *, n: int | None = None, temperature: float | None = None,
               seed: int | None = None) -> asyncio.Task[ChatReply | None]:
        """What Send does: answer ``prompt`` as a task on the running loop, one token between two turns of the
        loop. The task's result is the reply (None if the turn failed: the status line says why)."""
        opened = self._open(prompt, n, temperature, seed)
        try:
            loop = asyncio.get_running_loop()  # the kernel's, in a notebook
        except RuntimeError:
            raise ConfigError("submit runs the turn on a running event loop (a notebook's kernel); in a script, "
                              "use ask()") from None
        self.task = loop.create_task(self._answer(self._begin(*opened)))
        return self.task

    async def _answer(self, stream: ChatStream) -> ChatReply | None:
        try:
            for step in stream:
                self._step(step)
                await asyncio.sleep(0)  # the loop handles clicks and cells between two tokens
        except asyncio.CancelledError as e:
            stream.close()
            self._end(None, e)
            raise
        except Exception as e:
            stream.close()
            self._end(None, e)
            self.message = str(e)
            return None
        self._end(stream.reply, None)
        return stream.reply

    def stop(self) -> None:
        """Stop the turn being answered (its blocks are freed; the answer so far stays)."""
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def _on_msg(self, widget: Any, content: dict[str, Any], buffers: Any) -> None:
        if content.get("type") != "send":
            return super()._on_msg(widget, content, buffers)
        try:
            self.submit(content.get("prompt") or "", n=content.get("n"), temperature=content.get("temperature"))
        except ConfigError as e:
            self.message = str(e)  # the browser shows it; the view is unchanged

    # ------------------------------------------------------------------ static fallback
    def figure(self) -> Picture:
        return plot_chat(self.latest())


def check_answers(n: Any) -> int:
    """How many answers a turn forks: an int in 1..MAX_ANSWERS, else :class:`ConfigError` naming it."""
    if check_positive(n, "n (answers)") > MAX_ANSWERS:
        raise ConfigError(f"n (answers) must be at most {MAX_ANSWERS}, got {n!r}")
    return int(n)


def plot_chat(x: Any) -> Picture:
    """A ChatView's frame as a figure: the pool grid beside the conversation (the latest turns), the block tables
    of the latest request and each turn's status line."""
    f: Frame = as_frame(x)
    chat = f.tail.get("chat", {})
    fig = Picture(figsize=(13, 5.5), layout="constrained")
    pool_ax, text_ax = fig.subplots(1, 2, width_ratios=(1, 1.3))
    draw_pool(pool_ax, f)
    legend(fig, ["pool"], f, below=True)  # only the colours drawn; below: the transcript takes the right
    lines: list[str] = []
    for i, turn in list(enumerate(chat.get("turns", []), 1))[-3:]:
        lines += textwrap.wrap(f"第 {i} 轮，你 (you)：{turn['prompt']}", 80, max_lines=2)
        for j, answer in enumerate(turn["answers"], 1):
            who = "模型 (model)" if len(turn["answers"]) == 1 else f"回答 {j} (answer)"
            lines += textwrap.wrap(f"{who}：{answer}", 80, max_lines=4, initial_indent="  ", subsequent_indent="  ")
        lines += textwrap.wrap(turn["status"], 56, initial_indent="  ", subsequent_indent="  ")  # CJK: two columns
    for row in frame_tables(f)[0]:
        lines += textwrap.wrap(f"{row.label} 的块表 (block table)：{' '.join(map(str, row.blocks))}", 80)
    text_ax.text(0, 1, "\n".join(lines) or "还没有问题 (no question yet)", va="top", ha="left", fontsize=9, wrap=True)
    text_ax.set_axis_off()
    return fig

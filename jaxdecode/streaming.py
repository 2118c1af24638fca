"""Streaming: text pieces as the jit-compiled loop produces them.

    for piece in jaxdecode.stream(model, "def fib(n):", method="greedy", max_new_tokens=64):
        print(piece, end="", flush=True)          # piece: a str (with .row: which output row)

How it works, in three parts with one job each:

- **Device hook** (`emit`): the decoders' loops (autoregressive `_decode`, the speculative engine's
  commit) call it after each step with their output buffer and each row's output length before and
  after the step. Once a row crosses a multiple of `every` tokens (default 8), or ends, a
  `jax.experimental.io_callback` (inside a `lax.cond`) delivers every row's output so far; its first
  operand is the stream's id, a traced int32: the compiled program does not depend on which stream it
  feeds, so a second stream at the same shapes reuses it. Without a stream the decoders pass no id and
  the traced program has no callback at all (one-shot calls pay nothing). The callback answers whether
  the consumer abandoned the stream; the loop then ends its rows, so an abandoned decode stops early.
- **Host sink** (`TokenSink`): the callback copies the rows' tokens (a delivery older than what arrived
  changes nothing, so order does not matter) under a lock and wakes the consumer. It does nothing else:
  it runs inside the device computation.
- **Text** (`_RowText`): per row, incremental detokenisation in the consumer's thread: the text of the
  tokens received so far, less what must wait: a trailing incomplete UTF-8 sequence (U+FFFD) until a
  later token completes it, and the longest suffix that could begin a stop string until it is
  resolved (so no text past a stop string is ever yielded). When the decode ends, the final
  `Generation.text` (trimmed at a stop string, special tokens skipped like generate) supplies the rest,
  so the pieces of a row concatenate to exactly its one-shot text.

`stream()` runs `generate(..., _stream=sink)` in a worker thread; errors there re-raise in the consumer.
"""
from __future__ import annotations

import dataclasses
import itertools
import sys
import threading
import time
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

# Methods whose decoders call the hook: the autoregressive loop (also under an item-index constraint)
# and the speculative engine (an accepted block arrives as one piece).
STREAM_METHODS = ("greedy", "sample", "mirostat", "speculative", "constrained_greedy", "constrained_sample")


# Tokens per row between two deliveries to the host (a row's end is delivered at once).
DEFAULT_EVERY = 8


class StreamError(ValueError):
    """A stream that cannot run as asked."""


# ----------------------------------------------------------------------------- device hook
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StreamHandle:
    """What a decoder's jitted loop gets for a stream: the sink's id (a traced int32, so the compiled
    program does not depend on which sink) and the mesh the decode runs on (static)."""
    id: jax.Array
    mesh: Any = dataclasses.field(default=None, metadata=dict(static=True))
    every: int = dataclasses.field(default=1, metadata=dict(static=True))  # tokens between deliveries
    width: int = dataclasses.field(default=0, metadata=dict(static=True))  # output columns per row


def operand(stream, batch: int, width: int, mesh=None) -> StreamHandle | None:
    """The StreamHandle a decoder passes to its jitted loop (None without a stream: no callback is
    traced). `stream` must be a fresh TokenSink; it is sized here for `batch` rows of `width` columns.
    mesh: the decode's mesh (default: the sink's `mesh`, set by the method adapters)."""
    if stream is None:
        return None
    if not callable(getattr(stream, "attach", None)):
        raise StreamError(f"stream must be a jaxdecode.streaming.TokenSink, got {type(stream).__name__}")
    if jax.process_count() > 1:
        raise StreamError("streaming runs on one process (its host callback delivers on process 0 only); "
                          "decode without streaming on a multi-process mesh")
    return StreamHandle(id=jnp.int32(stream.attach(batch, width)),
                        mesh=mesh if mesh is not None else getattr(stream, "mesh", None),
                        every=int(getattr(stream, "every", 1)), width=int(width))


def emit(handle: StreamHandle, buffer, offset, n_before, n_after, done):
    """Inside a decoder's loop (traced): deliver the rows' output so far to the stream, once a row has
    crossed a multiple of `handle.every` tokens since the last step, a row finished, or a row is full.

    buffer int32[B, W]: each row's output starts at column offset[B] (a scalar: every row); n_before /
    n_after int32[B]: the row's output length before / after this step; done bool[B]: finished after
    this step. Returns a traced bool scalar: True once the consumer abandoned the stream (the caller ends
    its rows). A delivery carries every row's whole output so far (int32[B, width], a few KB), so the
    host needs no earlier one: deliveries may be skipped (every > 1: a host round trip costs about half a
    millisecond on a CPU host, as much as a small model's step) or arrive out of order."""
    b, width = n_after.shape[0], handle.width

    def deliver():
        from jax.experimental import io_callback
        start = jnp.broadcast_to(jnp.asarray(offset, jnp.int32), (b,))
        rows = jax.vmap(lambda row, s: jax.lax.dynamic_slice(jnp.pad(row, (0, width)), (s,), (width,)))(
            buffer.astype(jnp.int32), start)  # [B, width]: output column 0 first
        args = (rows, n_after.astype(jnp.int32), done)
        if handle.mesh is not None:  # gathered explicitly (a few ints): the callback runs on one device
            replicated = NamedSharding(handle.mesh, PartitionSpec())
            args = tuple(jax.lax.with_sharding_constraint(x, replicated) for x in args)
        # Unordered: each call carries the whole output so far, so the order of delivery does not matter.
        return io_callback(_deliver, jax.ShapeDtypeStruct((), jnp.bool_), handle.id, *args, ordered=False)

    every = max(int(handle.every), 1)
    send = (jnp.any(n_after // every > n_before // every) | jnp.any(done & (n_after > n_before))
            | jnp.any(n_after >= width) | jnp.all(done))
    return jax.lax.cond(send, deliver, lambda: jnp.bool_(False))




_SINKS: dict[int, "TokenSink"] = {}
_SINKS_LOCK = threading.Lock()
_NEXT_ID = itertools.count(1)


def _close_all():
    """At interpreter exit, before non-daemon threads are joined: abandoned streams' decodes stop at their
    next step instead of running to the end."""
    with _SINKS_LOCK:
        sinks = list(_SINKS.values())
    for sink in sinks:
        sink.close()


try:  # runs before the interpreter joins non-daemon threads (atexit runs after); concurrent.futures uses it
    threading._register_atexit(_close_all)
except (AttributeError, RuntimeError):
    pass


def _deliver(stream_id, tokens, counts, done):
    """Host side of `emit` (runs inside the device computation: keep it short). Data for a closed or
    unknown stream is dropped and the loop is told to stop."""
    with _SINKS_LOCK:
        sink = _SINKS.get(int(stream_id))
    if sink is None:
        return np.array(True)
    return np.array(sink.receive(np.asarray(tokens), np.asarray(counts), np.asarray(done)))


class TokenSink:
    """Where one decode's streamed tokens land: int32[B, W] by output column, which columns have arrived,
    which rows are finished. Thread-safe; the consumer waits on `changed`."""

    def __init__(self):
        self.id: int | None = None
        self.stops: tuple = ()  # the decode's stop strings (set by the method adapters: resolved options)
        self.mesh = None  # the decode's mesh (set by the method adapters)
        self._cond = threading.Condition()
        self._tokens = self._count = self._done = None
        self.every = 1  # tokens per row between deliveries (set by stream())
        self._closed = False
        self._version = 0  # bumped on every change the consumer may care about

    def attach(self, batch: int, width: int) -> int:
        """Size the buffers for one decode and register; returns the id the loop's callback carries."""
        with self._cond:
            if self.id is not None:
                raise StreamError("this TokenSink already streams a decode; use a new one per decode")
            self._tokens = np.zeros((batch, width), np.int32)
            self._count = np.zeros((batch,), np.int64)  # columns arrived per row
            self._done = np.zeros((batch,), bool)
            with _SINKS_LOCK:
                self.id = next(_NEXT_ID)
                _SINKS[self.id] = self
            self._bump()
            return self.id

    def receive(self, tokens, counts, done) -> bool:
        """Each row's output so far (its first counts[b] columns of tokens); returns whether the stream is
        closed. A delivery older than what arrived already changes nothing."""
        with self._cond:
            if self._closed:
                return True
            width = self._tokens.shape[1]
            for b in np.flatnonzero(counts > self._count):
                n = min(int(counts[b]), width)
                self._tokens[b, :n] = tokens[b, :n]
                self._count[b] = n
            self._done |= done.astype(bool)
            self._bump()
            return False

    def snapshot(self) -> tuple[list[np.ndarray], np.ndarray, int]:
        """(per row: its tokens arrived so far, done bool[B], version)."""
        with self._cond:
            if self._tokens is None:
                return [], np.zeros((0,), bool), self._version
            return ([self._tokens[b, :self._count[b]].copy() for b in range(len(self._count))], self._done.copy(),
                    self._version)

    def wait(self, version: int, timeout: float | None = None) -> None:
        """Block until something changed since `version` (or the timeout)."""
        with self._cond:
            self._cond.wait_for(lambda: self._version != version, timeout)

    def close(self) -> None:
        """Stop listening: later deliveries are dropped and tell the loop to stop."""
        with self._cond:
            self._closed = True
            self._bump()
        with _SINKS_LOCK:
            if self.id is not None:
                _SINKS.pop(self.id, None)

    def _bump(self):  # under self._cond
        self._version += 1
        self._cond.notify_all()


# ----------------------------------------------------------------------------- text
FFFD = "\ufffd"


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """How many characters of `text` may be shown while more may follow: up to the first stop string
    in it, and never its longest suffix that is a proper prefix of a stop string (it may become one)."""
    cut = len(text)
    if not stops:
        return cut
    for s in stops:
        i = text.find(s)
        if i >= 0:
            cut = min(cut, i)
        for k in range(min(len(s) - 1, len(text)), 0, -1):  # longest first
            if text.endswith(s[:k]):
                cut = min(cut, len(text) - k)
                break
    return cut


class _RowText:
    """One row's incremental detokenisation (vLLM-style offsets, so each update decodes a short window):
    `text` grows by the window's new text once it ends in a complete character. The window starts at the
    previous read point, so tokenizers that drop the first token's leading space (SentencePiece) decode
    both halves alike."""

    def __init__(self, decode):
        self.decode = decode
        self.text = ""
        self.prefix = self.read = 0  # token offsets: window start, end of what `text` covers
        self.shown = 0  # characters of `text` yielded

    def update(self, tokens: np.ndarray) -> None:
        n = len(tokens)
        if n <= self.read:
            return
        before = self.decode(tokens[self.prefix:self.read])
        after = self.decode(tokens[self.prefix:n])
        if after.endswith(FFFD):
            return  # an incomplete UTF-8 sequence: wait for the token that completes it
        if after.startswith(before):
            self.text += after[len(before):]
        else:  # the tokenizer rewrote the window's text (e.g. clean-up of spaces): decode the whole row
            self.text = self.decode(tokens[:n])
        self.prefix, self.read = self.read, n


class Piece(str):
    """A streamed text piece: a str, with `.row` the output row it belongs to (0 for one prompt)."""
    row: int

    def __new__(cls, text: str, row: int):
        piece = super().__new__(cls, text)
        piece.row = row
        return piece


# ----------------------------------------------------------------------------- the stream
class _Job:
    """One generate call in a worker thread, feeding `sink`; what it returned or raised. The consumer's
    generator holds this, not the Stream, so dropping an abandoned Stream closes its sink at once."""

    def __init__(self, model, prompts, method, kwargs: dict, every: int = 1):
        self.model, self.prompts, self.method, self.kwargs = model, prompts, method, kwargs
        self.sink = TokenSink()
        self.sink.every = every
        self.results = None
        self.error: BaseException | None = None
        self.finished = False
        self.thread = None

    def start(self):
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="jaxdecode-stream", daemon=False)
            self.thread.start()

    def _run(self):
        from jaxdecode.api import generate
        try:
            self.results = generate(self.model, self.prompts, self.method, _stream=self.sink, **self.kwargs)
        except BaseException as e:  # re-raised in the consumer
            self.error = e
        finally:
            with self.sink._cond:
                self.finished = True
                self.sink._bump()


def _pieces(job: _Job, skip_special_tokens: bool, stops: tuple, interval: float, done: list):
    """The pieces of `job` as they arrive, then each row's rest from its final text; sets done[0] once
    exhausted (not when abandoned)."""
    job.start()
    sink, model = job.sink, job.model
    rows: list[_RowText] = []

    def decode(tokens) -> str:
        return model.decode([int(t) for t in tokens], skip_special_tokens=skip_special_tokens)

    def showable(text: str) -> int:
        """Characters of a row's text that may be yielded now."""
        cut = stop_holdback(text, stops or sink.stops)
        if getattr(model.tokenizer, "clean_up_tokenization_spaces", False):
            # The clean-up rewrites " ." -> "." etc.: trailing spaces wait for the next token.
            cut = min(cut, len(text[:cut].rstrip(" ")))
        return cut

    try:
        version = -1
        while True:
            sink.wait(version, timeout=1.0)
            with sink._cond:
                finished = job.finished
            if finished:
                break
            tokens, _, version = sink.snapshot()
            while len(rows) < len(tokens):
                rows.append(_RowText(decode))
            for r, (row, toks) in enumerate(zip(rows, tokens)):
                row.update(toks)
                show = showable(row.text)
                if show > row.shown:
                    piece, row.shown = row.text[row.shown:show], show
                    yield Piece(piece, r)
            if interval:
                # Detokenising holds the GIL, which the loop's callback needs: at most one round per
                # interval, so a fast loop is not slowed by a consumer woken at every step; the end of
                # the decode wakes it at once.
                with sink._cond:
                    sink._cond.wait_for(lambda: job.finished, interval)
        if job.error is not None:
            raise job.error
        # The final texts give the rest (trimmed at a stop string, as generate returns them).
        for r, gen in enumerate(job.results):
            shown = rows[r].text[:rows[r].shown] if r < len(rows) else ""
            if not gen.text.startswith(shown):  # a tokenizer that rewrote text already shown
                warnings.warn(f"stream row {r}: the text already streamed is not a prefix of the final text "
                              f"(the tokenizer rewrote earlier text); the pieces do not add up to "
                              f".results[{r}].text", RuntimeWarning, stacklevel=2)
                continue
            if len(gen.text) > len(shown):
                yield Piece(gen.text[len(shown):], r)
        done[0] = True
    finally:  # exhausted, abandoned or failed: nothing listens any more
        sink.close()


class Stream:
    """An iterator of `Piece`s (str with .row) from one generate call decoded in a worker thread; see
    `stream`. After exhaustion `.results` holds the Generations (exactly what generate returns), and
    each row's pieces concatenate to its Generation's text. `close()`, leaving a `with` block, or
    dropping the Stream (e.g. breaking out of `for piece in jaxdecode.stream(...)`) abandons the decode:
    it stops at its next step."""

    def __init__(self, model, prompts, method, generate_kwargs: dict, skip_special_tokens: bool, stops: tuple,
                 interval: float = 0.02, every: int = DEFAULT_EVERY):
        self._job = _Job(model, prompts, method, generate_kwargs, every)
        self._done = [False]
        self._gen = _pieces(self._job, skip_special_tokens, stops, interval, self._done)

    def __iter__(self):
        return self

    def __next__(self) -> Piece:
        return next(self._gen)

    @property
    def results(self) -> list:
        """The Generations (as generate returns them); only once the stream is exhausted."""
        if not self._done[0]:
            raise StreamError("the stream is not finished: iterate it to the end first (or call .finish())")
        return self._job.results

    def finish(self) -> list:
        """Consume what is left (dropping the pieces) and return the results."""
        for _ in self:
            pass
        return self.results

    def close(self) -> None:
        """Abandon the stream: the decode stops at its next step; no more pieces."""
        self._job.sink.close()
        self._gen.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self, _finalizing=sys.is_finalizing):  # an abandoned stream must not keep the decode running
        # At interpreter exit this module's globals may already be None (hence the bound default), and no
        # decode outlives the interpreter anyway.
        job = self.__dict__.get("_job")
        if job is not None and not _finalizing():
            job.sink.close()


def stream(model, prompts=None, method: str | None = None, max_new_tokens: int | None = None, *,
           skip_special_tokens: bool = True, every: int = None, interval: float = 0.02, **options) -> Stream:
    """Like `jaxdecode.generate`, but returns a `Stream`: iterate it for text pieces as the loop produces
    them (each a str `Piece` with `.row`, the output row: always 0 for one prompt), then read
    `.results` (the list of Generations generate would return).

    Methods: greedy, sample, mirostat, speculative (an accepted block arrives as one piece) and the
    constrained autoregressive ones. The output is the one-shot call's, token for token (sampling: same
    seed); each row's pieces concatenate to its Generation.text. With stop strings no text past a stop
    string is yielded (text that could begin one waits until it is resolved). The compiled program is
    the one-shot's plus a host callback every `every` tokens (default DEFAULT_EVERY = 8; 1 = every step:
    a host round trip costs ~0.5 ms on a CPU host, as much as a small model's step, so deliveries are
    batched; a row's end is delivered at once); a second stream at the same shapes compiles nothing.
    With several prompts (or num_return_sequences) the rows' pieces interleave as they come: route them
    by `.row`, or use `stream_to`. `interval`: seconds between two rounds of detokenisation at most (a
    piece shows up at most that late; 0: at every step, which slows a fast loop: the text is decoded
    while the loop's host callback waits for the GIL).
    """
    if not (isinstance(interval, (int, float)) and not isinstance(interval, bool) and 0 <= interval < 10):
        raise StreamError(f"interval must be seconds in [0, 10), got {interval!r}")
    every = DEFAULT_EVERY if every is None else every
    if not (isinstance(every, int) and not isinstance(every, bool) and every >= 1):
        raise StreamError(f"every must be an int >= 1 (tokens per row between deliveries), got {every!r}")
    from jaxdecode.registry import get_method
    name = method
    if name is None:  # as generate chooses: the generation config's method
        cfg = options.get("generation_config") or getattr(model, "generation_config", None)
        name = cfg.method() if cfg is not None and callable(getattr(cfg, "method", None)) else "greedy"
    canonical = get_method(name).name
    if canonical not in STREAM_METHODS:
        raise StreamError(f"method {canonical!r} cannot stream (its output is known only at the end); streaming "
                          f"methods: {', '.join(STREAM_METHODS)}. Use jaxdecode.generate for {canonical!r}")
    if options.get("_stream") is not None:
        raise StreamError("stream() makes its own sink; do not pass _stream")
    stops = options.get("stop")
    stops = () if stops is None else ((stops,) if isinstance(stops, str) else tuple(stops))
    kwargs = dict(options, max_new_tokens=max_new_tokens, skip_special_tokens=skip_special_tokens)
    return Stream(model, prompts, method, kwargs, skip_special_tokens, stops, float(interval), every)


def stream_to(file, model, prompts=None, method: str | None = None, max_new_tokens: int | None = None, *,
              sep: str = "\n", prefix=None, **options) -> list:
    """Write a stream's text to `file` (e.g. sys.stdout) as it comes, flushing each piece; returns the
    Generations. One row is shown at a time: row 0's pieces as they come; the other rows' text (held
    meanwhile) follows in order, each after `sep`, when the decode ends — the file reads like the texts
    of generate one after another. prefix(row, prompt) -> str, when given, is written before each row's
    text (e.g. a header naming the prompt)."""
    from jaxdecode.api import _prompt_list
    s = stream(model, prompts, method, max_new_tokens, **options)
    head = (lambda row, prompt: "") if prefix is None else prefix  # written before each row's text
    held: dict[int, list[str]] = {}
    file.write(head(0, _prompt_list(prompts, options.get("messages"))[0]))
    with s:
        for piece in s:
            if piece.row == 0:
                file.write(str(piece))
                file.flush()
            else:
                held.setdefault(piece.row, []).append(str(piece))
        results = s.results
    for r in range(1, len(results)):
        file.write(sep + head(r, results[r].prompt) + "".join(held.get(r, [])))
    file.write(sep)
    file.flush()
    return results

__all__ = ["STREAM_METHODS", "Piece", "Stream", "StreamError", "StreamHandle", "TokenSink", "emit", "operand", "stream",
           "stream_to", "stop_holdback"]

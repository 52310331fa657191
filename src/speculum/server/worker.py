"""One thread runs the generations of one model, one request at a time, from a bounded queue.

The model and its drafters are not thread-safe (one KV cache, drafters with per-request state),
so requests never run side by side: each waits its turn in the queue, then the worker thread
runs it step by step and hands every step to the request's asyncio queue. Between two steps it
checks whether the client has gone (cancel) or the request ran out of time; either way it closes
the generation, so the engine ends the request properly (the drafter's ``finish`` runs and
persistent pools learn what was generated).
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from speculum.api import IncrementalText, Speculum
from speculum.errors import SpeculumError
from speculum.methods import SpeculativeConfig
from speculum.server.metrics import Metrics
from speculum.server.protocol import ApiError, timeout_error
from speculum.stats import Stats

log = logging.getLogger("speculum.server")


@dataclass
class Piece:
    """The text of one output token and where the token came from."""

    text: str
    source: str  # "draft": an accepted draft token; "target": the target's own token (bonus or correction)
    token: bool = True  # False for text that no token of its own carries (a decoding tail)


class Output:
    """The output text of one request as its tokens arrive, cut at the first stop string.

    Text is handed out (``take``) only where no stop string can still begin: an end of the text
    that a stop string starts with waits for the next tokens, so a client never receives text
    that a stop string later takes back. Each step costs what its new text costs: every stop string
    is followed by a matcher that reads each character once, never the whole output again.
    """

    def __init__(self, stop: list[str]):
        self.stop = stop
        self._matchers = [StopMatcher(s) for s in stop]
        self.pieces: list[Piece] = []
        self.length = 0  # characters of output text
        self.shown = 0  # pieces handed out so far
        self.shown_chars = 0
        self.stopped = False  # a stop string was found
        self.num_tokens = 0  # output tokens (up to the one that completed the stop string)

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.pieces)

    def add(self, pieces: list[Piece]) -> None:
        if self.stopped:
            return
        new = "".join(p.text for p in pieces)
        begin = self.length
        self.pieces.extend(pieces)
        self.length += len(new)
        self.num_tokens += sum(p.token for p in pieces)
        hits = []  # (start, stop string) of each stop string's first occurrence
        for matcher in self._matchers:
            end = matcher.feed(new)
            if end >= 0:
                hits.append((begin + end - len(matcher.stop), matcher.stop))
        if hits:
            self._cut(*min(hits))

    def _cut(self, at: int, stop: str) -> None:
        """Keep the text before the stop string and the tokens up to the one that completed it."""
        end, pos, kept, tokens = at + len(stop), 0, [], 0
        for piece in self.pieces:
            if pos >= end:
                break
            kept.append(Piece(piece.text[: max(0, at - pos)], piece.source, piece.token))
            tokens += piece.token
            pos += len(piece.text)
        self.pieces, self.length, self.num_tokens, self.stopped = kept, at, tokens, True

    def _pending_stop(self) -> int:
        """Length of the longest end of the text that a stop string begins with (it may still complete)."""
        return max((m.matched for m in self._matchers), default=0)

    def take(self, final: bool = False) -> list[Piece]:
        """The pieces that may be shown now (all of them once the output is complete)."""
        limit = self.length if final or self.stopped else self.length - self._pending_stop()
        out = []
        while self.shown < len(self.pieces) and self.shown_chars + len(self.pieces[self.shown].text) <= limit:
            out.append(self.pieces[self.shown])
            self.shown_chars += len(self.pieces[self.shown].text)
            self.shown += 1
        return out


class StopMatcher:
    """Finds one stop string in text fed piece by piece (Knuth-Morris-Pratt): ``matched`` is the
    longest beginning of the stop string that the text so far ends with."""

    def __init__(self, stop: str):
        self.stop = stop
        # fallback[i]: the longest proper beginning of stop[: i + 1] that also ends it
        self.fallback = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.fallback[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.fallback[i] = k
        self.matched = 0

    def feed(self, text: str) -> int:
        """Read ``text``; the index in it just past the first complete stop string, or -1."""
        stop, fallback, k = self.stop, self.fallback, self.matched
        for i, char in enumerate(text):
            while k and char != stop[k]:
                k = fallback[k - 1]
            if char == stop[k]:
                k += 1
                if k == len(stop):
                    self.matched = 0  # the output ends here
                    return i + 1
        self.matched = k
        return -1


# ---------------------------------------------------------------------------------------- events


@dataclass
class Started:
    """The generation began (the method's drafter exists, the parameters passed)."""


@dataclass
class Tokens:
    pieces: list[Piece]
    num_output_tokens: int  # committed so far (speculation progress: what the page shows live)
    num_spec_steps: int
    num_accepted_tokens: int  # of them, accepted draft tokens
    elapsed: float  # seconds since the generation started


@dataclass
class Finished:
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    num_tokens: int  # output tokens (usage.completion_tokens)
    stats: Stats
    method: str
    time_to_first_token: float | None
    queue_time: float


@dataclass
class Failed:
    error: ApiError


# ---------------------------------------------------------------------------------------- jobs


@dataclass
class Job:
    """One request: what to generate, and the asyncio queue its events go to."""

    prompt_ids: list[int]
    config: SpeculativeConfig
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    timeout: float  # seconds from arrival, queueing included
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    cancel_reason: str = "cancelled"  # or "timeout": the handler gave up on a request still queued
    started: bool = False  # the worker has taken it from the queue
    arrival: float = field(default_factory=time.monotonic)

    def emit(self, event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed (server shutting down): nobody is listening
            pass

    def cancel(self, reason: str = "cancelled") -> None:
        if not self.cancelled.is_set():
            self.cancel_reason = reason
            self.cancelled.set()

    @property
    def expired(self) -> bool:
        return time.monotonic() - self.arrival > self.timeout


class Worker:
    """Runs the requests of one ``Speculum`` one at a time in its own thread (see the module docstring)."""

    def __init__(
        self,
        spec: Speculum,
        metrics: Metrics,
        max_queue: int,
        *,
        max_configs: int = 16,
        default_config: SpeculativeConfig | None = None,
        save_interval: float = 60.0,
    ):
        self.spec = spec
        self.metrics = metrics
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="speculum-worker", daemon=True)
        self._running: Job | None = None
        self._mean_seconds = 1.0  # moving average of request durations, for Retry-After
        # Every distinct method configuration builds (and keeps) a drafter; clients may send many,
        # so only the most recent ``max_configs`` are kept, the server's own one always.
        self._configs: OrderedDict[tuple, SpeculativeConfig] = OrderedDict()
        self._max_configs = max_configs
        self._pinned = (default_config or spec.default_config).key()
        # Pools with a pool_path are saved between requests, at most every save_interval seconds
        # (and at shutdown): never on a request's way, so a failed write fails no request.
        self._save_interval = save_interval
        self._last_save = time.monotonic()
        self._unsaved = False  # a generation has run since the last save
        metrics.queue_length.set_function(self._queue.qsize)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue ``job``; ApiError 503 (with Retry-After) when the queue is full or the server is stopping."""
        if self._stop.is_set():
            raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            wait = min(60, max(1, math.ceil(self._mean_seconds * (self._queue.qsize() + 1))))
            raise ApiError(
                503,
                f"the server is busy: {self._queue.maxsize} requests are waiting already; retry in {wait} s",
                type="server_error",
                code="queue_full",
                headers={"Retry-After": str(wait)},
            ) from None

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel the running request, refuse the queued ones, and wait for the thread to end."""
        self._stop.set()
        if self._running is not None:
            self._running.cancel()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            job.emit(Failed(ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")))
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the thread

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                job = self._queue.get(timeout=0.2)
            except queue.Empty:
                self._save_if_due()
                continue
            self._running = job
            started = time.monotonic()
            try:
                self._run(job)
            except Exception:  # a bug, not bad input: the request fails, the server goes on
                log.exception("generation failed")
                job.emit(Failed(ApiError(500, "internal error while generating", type="server_error")))
                self.metrics.requests.labels(job.config.method, "error").inc()
            finally:
                self._running = None
                self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * (time.monotonic() - started)
            self._save_if_due()

    def _save_if_due(self) -> None:
        if self._unsaved and time.monotonic() - self._last_save >= self._save_interval:
            self._unsaved = False  # a failed save is tried again after the next generation (or at shutdown)
            self._last_save = time.monotonic()
            save_pools(self.spec, self.metrics)

    def _run(self, job: Job) -> None:
        job.started = True
        method = job.config.method
        if job.cancelled.is_set():  # the client left (or its time ran out) while the request was queued
            self.metrics.requests.labels(method, job.cancel_reason).inc()
            return
        if job.expired:
            job.emit(Failed(timeout_error(job.timeout)))
            self.metrics.requests.labels(method, "timeout").inc()
            return
        queue_time = time.monotonic() - job.arrival
        self._keep_config(job.config)
        try:
            drafter = self.spec.drafter_for(job.config)
            if hasattr(drafter, "save_on_finish"):
                drafter.save_on_finish = False  # Ouroboros: the worker saves its pool (see _save_if_due)
            stream = self.spec.generate(
                job.prompt_ids,
                job.config,
                stream=True,
                max_new_tokens=job.max_tokens,
                temperature=job.temperature,
                top_p=job.top_p,
                top_k=job.top_k,
                seed=job.seed,
            )
        except SpeculumError as exc:  # e.g. a method that needs a draft model the server has not loaded
            job.emit(Failed(ApiError(400, str(exc), param="speculative_config")))  # counted by the handler
            return
        job.emit(Started())
        self._unsaved = True
        self.metrics.running.inc()
        try:
            self._steps(job, stream, method, queue_time)
        finally:
            self.metrics.running.dec()

    def _steps(self, job: Job, stream, method: str, queue_time: float) -> None:
        output, text = Output(job.stop), IncrementalText(self.spec.decode)
        ids: list[int] = []
        steps = accepted = 0
        first_token = None
        ended = ""  # why we stopped reading early: stop, cancelled or timeout
        chunks = iter(stream)
        try:
            for chunk in chunks:
                if not chunk.token_ids:  # the stream's closing text: we decode ourselves, token by token
                    continue
                if first_token is None:
                    first_token = time.monotonic()
                steps += 1
                accepted += chunk.num_draft_tokens
                pieces = []
                for i, token in enumerate(chunk.token_ids):
                    ids.append(token)
                    pieces.append(Piece(text.add(ids), "draft" if i < chunk.num_draft_tokens else "target"))
                output.add(pieces)
                shown = output.take()
                if shown:
                    elapsed = time.monotonic() - job.arrival - queue_time
                    job.emit(Tokens(shown, len(ids), steps, accepted, elapsed))
                if output.stopped:
                    ended = "stop"
                elif job.cancelled.is_set():
                    ended = job.cancel_reason
                elif self._stop.is_set():  # the server is shutting down
                    ended = "cancelled"
                elif job.expired:
                    ended = "timeout"
                if ended:
                    break
        finally:
            chunks.close()  # ends the engine's request (the drafter's finish runs) if we stopped early
        result = stream.result
        stats = result.stats if result is not None else Stats()
        if ended in ("cancelled", "timeout"):
            if ended == "timeout":
                job.emit(Failed(timeout_error(job.timeout)))
            self.metrics.requests.labels(method, ended).inc()
            return
        tail = text.finish(self.spec.decode(ids)) if not ended else ""
        if tail:  # text the incremental decoding held back to the end (an incomplete character)
            output.add([Piece(tail, "target", token=False)])
        finish_reason = "stop" if output.stopped or stats.stop_reason == "eos" else "length"
        rest = output.take(final=True)
        if rest:
            job.emit(Tokens(rest, len(ids), steps, accepted, time.monotonic() - job.arrival - queue_time))
        ttft = None if first_token is None else first_token - job.arrival
        job.emit(Finished(finish_reason, output.num_tokens, stats, method, ttft, queue_time))
        self.metrics.observe(method, finish_reason, len(job.prompt_ids), output.num_tokens, stats, ttft, job.arrival)

    def _keep_config(self, config: SpeculativeConfig) -> None:
        """Remember ``config`` as recently used; forget the drafter of the least recently used one beyond
        ``max_configs`` (never the server's own configuration, whose pools are saved at shutdown)."""
        key = config.key()
        self._configs[key] = config
        self._configs.move_to_end(key)
        while len(self._configs) > self._max_configs:
            old = next(k for k in self._configs if k != self._pinned)
            self.spec.forget(self._configs.pop(old))  # its drafter, and shared pools no other drafter uses


def save_pools(spec: Speculum, metrics: Metrics | None = None) -> list[str]:
    """Save the pools of the drafters that have a ``pool_path`` (ANPD, lookahead, Ouroboros), atomically.

    Called on the worker thread between requests, or at shutdown after it has ended: never while a
    request is changing them. Returns the paths written; a pool that cannot be written is logged
    (and counted in ``metrics``), the others are still saved.
    """
    saved = []
    for drafter in spec.built_drafters():
        path = getattr(getattr(drafter, "options", None), "pool_path", None)
        if path is None or not hasattr(drafter, "save"):
            continue
        try:
            drafter.save()
            saved.append(str(path))
        except Exception as exc:  # a full disk or a bug in saving: the server goes on serving
            if metrics is not None:
                metrics.pool_save_failures.inc()
            expected = isinstance(exc, SpeculumError)
            log.error("could not save the pool of %s: %s", drafter.name, exc, exc_info=not expected)
    return saved

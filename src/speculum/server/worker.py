"""One thread runs the generations of one model, as rows of one batch, from a bounded queue.

The model and its drafters are not thread-safe, so one worker thread runs everything: continuous
batching. Up to ``max_batch`` requests decode together, one target forward per step
carrying every row's draft (``engine.Batch``); a queued request joins between two steps, after its
prefill, which runs ``prefill_chunk`` tokens at a time while other rows decode, so a long prompt
holds the running streams for about a step at a time. Each row's tokens go to its request's
asyncio queue after every step. Between steps the worker checks whether a client has gone
(cancel) or a request ran out of time; either way its row leaves the batch at once and its
drafter's ``finish`` runs (persistent pools learn what was generated). A request whose generation
raises fails alone (500), its row out of the batch, while the others decode on; at shutdown every
request still in flight or queued gets a 503, so that no handler waits for an event that never comes.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from speculum import engine
from speculum.api import IncrementalText, Speculum
from speculum.errors import SpeculumError
from speculum.methods import SpeculativeConfig
from speculum.sampling import SamplingParams
from speculum.server.jobs import Failed, Finished, Job, Started, Tokens, internal_error, shutting_down
from speculum.server.metrics import Metrics
from speculum.server.output import Output, Piece
from speculum.server.protocol import ApiError, timeout_error

log = logging.getLogger("speculum.server")

STARVING = 2.0  # seconds after which a waiting prompt is prefilled before shorter ones


@dataclass
class Active:
    """A job whose request is in the batch (or being prefilled to join it): its row and its output so far."""

    job: Job
    request: engine.Request
    drafter: object
    queue_time: float
    joining: engine.Joining | None = None  # its prefill, until it joins
    row: engine.Row | None = None
    output: Output = None  # type: ignore[assignment]
    text: IncrementalText = None  # type: ignore[assignment]
    ids: list[int] = field(default_factory=list)
    steps: int = 0
    accepted: int = 0  # accepted draft tokens so far
    first_token: float | None = None


class Worker:
    """Runs the requests of one ``Speculum`` in its own thread, as rows of one batch (see the module
    docstring)."""

    def __init__(
        self,
        spec: Speculum,
        metrics: Metrics,
        max_queue: int,
        *,
        max_batch: int = 16,
        prefill_chunk: int = 256,
        max_configs: int = 16,
        default_config: SpeculativeConfig | None = None,
        save_interval: float = 60.0,
    ):
        self.spec = spec
        self.metrics = metrics
        self.max_batch = max_batch
        # prompt tokens prefilled between two steps: a long prompt joins over several steps instead
        # of holding every running stream for its whole prefill
        self.prefill_chunk = prefill_chunk
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="speculum-worker", daemon=True)
        self._alive = lambda: True
        self._batch = engine.Batch(spec.runner, isolate=True)
        self._queue_lock = threading.Lock()  # no job is queued after the queue is emptied at shutdown
        self._active: list[Active] = []  # in the batch or joining it, in arrival order
        self._mean_seconds = 1.0  # moving average of request durations, for Retry-After
        # Every distinct method configuration builds (and keeps) drafters; clients may send many,
        # so only the most recent ``max_configs`` are kept, the server's own one always.
        self._configs: OrderedDict[tuple, SpeculativeConfig] = OrderedDict()
        self._max_configs = max_configs
        self._pinned = (default_config or spec.default_config).key()
        # Pools with a pool_path are saved between steps, at most every save_interval seconds (and at
        # shutdown): never on a request's way, so a failed write fails no request.
        self._save_interval = save_interval
        self._last_save = time.monotonic()
        self._unsaved = False  # a generation has run since the last save
        metrics.queue_length.set_function(self._queue.qsize)
        metrics.running.set_function(lambda: len(self._active))

    def start(self) -> None:
        """Run the requests in a thread of the worker's own."""
        self._thread.start()

    def run(self, alive=lambda: True) -> None:
        """Run the requests in the calling thread until stopped (or until ``alive()`` turns false).

        ``speculum serve`` runs it in the thread that loaded the model: torch's OpenMP threads are
        a team per calling thread, and once the loading thread has one, a second thread's team runs
        the model markedly slower (see docs/batching.md)."""
        self._alive = alive
        self._loop()

    def submit(self, job: Job) -> None:
        """Queue ``job``; ApiError 503 (with Retry-After) when the queue is full or the server is stopping."""
        try:
            with self._queue_lock:
                if self._stop.is_set():
                    raise shutting_down()
                self._queue.put_nowait(job)
        except queue.Full:
            rounds = (self._queue.qsize() + 1) / self.max_batch
            wait = min(60, max(1, math.ceil(self._mean_seconds * rounds)))
            raise ApiError(
                503,
                f"the server is busy: {self._queue.maxsize} requests are waiting already; retry in {wait} s",
                type="server_error",
                code="queue_full",
                headers={"Retry-After": str(wait)},
            ) from None

    def stop(self, timeout: float = 30.0) -> None:
        """End the running requests and refuse the queued ones (each gets a 503), and wait for the
        thread to end."""
        self._stop.set()
        self._refuse_queued()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _refuse_queued(self) -> None:
        with self._queue_lock:
            while True:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    return
                job.emit(Failed(shutting_down()))

    # ------------------------------------------------------------------ the thread

    def _loop(self) -> None:
        while not self._stop.is_set() and self._alive():
            self._admit()
            if not self._active:
                self._save_if_due()
                continue
            try:
                self._prefill()
                if self._batch.rows:
                    started = time.perf_counter()
                    results = self._batch.step()
                    self.metrics.decode_seconds.inc(time.perf_counter() - started)
                    for row, error in self._batch.failed:  # rows that raised: out of the batch already
                        log.error("a generation failed", exc_info=error)
                        self._fail(self._of(row))
                    for row, new in results:
                        active = self._of(row)
                        try:
                            self._tokens(active, new)
                        except Exception:
                            log.exception("a generation failed")
                            self._fail(active)
            except Exception:  # no row to blame (e.g. the rows' forward fails only together): all fail
                log.exception("generation failed")
                for active in list(self._active):
                    self._fail(active)
                self._batch = engine.Batch(self.spec.runner, isolate=True)
            self._save_if_due()
        for active in list(self._active):  # shutting down: every request still in flight ends now
            self._end(active, "shutdown")
        self._stop.set()  # where the server's thread has ended, nobody else stops the worker
        self._refuse_queued()

    def _of(self, row: engine.Row) -> Active:
        return next(a for a in self._active if a.row is row)

    def _admit(self) -> None:
        """Take queued jobs while the batch has room (waiting a little for one when nothing runs)."""
        while len(self._active) < self.max_batch:
            try:
                job = self._queue.get(timeout=0.2) if not self._active else self._queue.get_nowait()
            except queue.Empty:
                return
            try:
                self._begin(job)
            except Exception:  # a bug, not bad input: this request fails, the others go on
                log.exception("could not start a generation")
                job.emit(Failed(internal_error()))
                self.metrics.requests.labels(job.config.method, "error").inc()

    def _begin(self, job: Job) -> None:
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
            drafter = self._free_drafter(job.config, sampled=not SamplingParams(job.temperature).greedy)
            if hasattr(drafter, "save_on_finish"):
                drafter.save_on_finish = False  # Ouroboros: the worker saves its pool (see _save_if_due)
            # a request that joins others gets a controller of its own (a lone one runs as
            # `speculum generate` would, with its configuration's)
            batched = bool(self._active)
            request = self.spec.request(
                job.prompt_ids, job.config, drafter, max_new_tokens=job.max_tokens, temperature=job.temperature,
                top_p=job.top_p, top_k=job.top_k, seed=job.seed, own_controller=batched,
            )  # fmt: skip
            request = engine.check(self.spec.runner, request)
        except SpeculumError as exc:  # e.g. a method that needs a draft model the server has not loaded
            job.emit(Failed(ApiError(400, str(exc), param="speculative_config")))  # counted by the handler
            return
        job.emit(Started())
        self._unsaved = True
        active = Active(job, request, drafter, queue_time, engine.Joining(self.spec.runner, request))
        active.output, active.text = Output(job.stop), IncrementalText(self.spec.decode)
        self._active.append(active)

    def _free_drafter(self, config: SpeculativeConfig, sampled: bool):
        """A drafter of ``config`` for a greedy or ``sampled`` request that no request in flight uses
        (drafters keep per-request state)."""
        busy = {id(a.drafter) for a in self._active}
        count = sum(1 for a in self._active if a.job.config.key() == config.key()) + 1
        return next(d for d in self.spec.drafters_for(config, count, sampled) if id(d) not in busy)

    def _prefill(self) -> None:
        """Prefill joining requests, at most ``prefill_chunk`` tokens, and add those whose prefill is
        complete to the batch. Even with no row decoding the budget holds: a burst of requests
        then starts decoding its shortest prompts after the first chunk, instead of every request
        waiting for the whole burst's prefill before its first token.

        The prompt with the fewest tokens left goes first (the median time to first token is what
        clients wait on; a short prompt arriving during a long one's prefill overtakes it), except
        that a request that has waited ``STARVING`` seconds goes before the others, so a long
        prompt is never overtaken for ever."""
        budget = self.prefill_chunk
        now = time.monotonic()

        def order(active: Active) -> tuple:
            return (now - active.job.arrival <= STARVING, active.joining.left)

        for active in sorted((a for a in self._active if a.joining is not None), key=order):
            if self._ended_early(active):
                continue
            joining = active.joining
            if budget <= 0 and joining.left > 0:
                break
            started = time.perf_counter()
            take = min(budget, joining.left)
            budget -= take
            try:  # a request whose prefill or drafter's start raises fails alone (admit leaves the batch as it was)
                done = joining.prefill(take)
                self.metrics.prefill_seconds.inc(time.perf_counter() - started)
                if done:
                    active.row = self._batch.admit(joining)
                    active.joining = None
            except Exception:
                log.exception("could not prefill a request")
                self._fail(active)

    def _tokens(self, active: Active, new: list[int]) -> None:
        """A step's tokens for ``active``: hand out its text, and end it where it ends."""
        job, row = active.job, active.row
        if active.first_token is None:
            active.first_token = time.monotonic()
        active.steps += 1
        stats = row.stats
        drafted = min(len(new), stats.accepted_tokens - active.accepted)
        active.accepted = stats.accepted_tokens
        pieces = []
        for i, token in enumerate(new):
            active.ids.append(token)
            pieces.append(Piece(active.text.add(active.ids), "draft" if i < drafted else "target"))
        active.output.add(pieces)
        shown = active.output.take()
        if shown:
            elapsed = time.monotonic() - job.arrival - active.queue_time
            job.emit(Tokens(shown, len(active.ids), active.steps, active.accepted, elapsed))
        if active.output.stopped:
            self._end(active, "stop")
        elif row.done:
            self._end(active, "")
        else:
            self._ended_early(active)

    def _ended_early(self, active: Active) -> bool:
        """End ``active`` if its client left, its time ran out or the server is stopping."""
        job = active.job
        ended = job.cancel_reason if job.cancelled.is_set() else "shutdown" if self._stop.is_set() else ""
        ended = ended or ("timeout" if job.expired else "")
        if ended:
            self._end(active, ended)
        return bool(ended)

    def _end(self, active: Active, ended: str) -> None:
        """The request is over: ``ended`` says why, if it stopped before its own end (EOS, length)."""
        job, method, stats = active.job, active.job.config.method, active.request.stats
        self._release(active, ended)
        if ended in ("cancelled", "timeout", "shutdown"):
            if ended != "cancelled":  # (a cancelled request's client has gone)
                job.emit(Failed(timeout_error(job.timeout) if ended == "timeout" else shutting_down()))
            self.metrics.requests.labels(method, "cancelled" if ended == "shutdown" else ended).inc()
            return
        tail = active.text.finish(self.spec.decode(active.ids)) if not ended else ""
        if tail:  # text the incremental decoding held back to the end (an incomplete character)
            active.output.add([Piece(tail, "target", token=False)])
        finish_reason = "stop" if active.output.stopped or stats.stop_reason == "eos" else "length"
        rest = active.output.take(final=True)
        now = time.monotonic()
        if rest:
            job.emit(
                Tokens(rest, len(active.ids), active.steps, active.accepted, now - job.arrival - active.queue_time)
            )
        ttft = None if active.first_token is None else active.first_token - job.arrival
        job.emit(Finished(finish_reason, active.output.num_tokens, stats, method, ttft, active.queue_time))
        self.metrics.observe(
            method, finish_reason, len(job.prompt_ids), active.output.num_tokens, stats, ttft, job.arrival
        )
        self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * (now - job.arrival)

    def _fail(self, active: Active) -> None:
        """``active``'s generation raised (a bug, not bad input): it fails alone, the others go on."""
        active.job.emit(Failed(internal_error()))
        self.metrics.requests.labels(active.job.config.method, "error").inc()
        self._release(active, "error")

    def _release(self, active: Active, reason: str = "cancelled") -> None:
        """Take ``active`` out of the batch (its row at once) and free its drafter."""
        if active in self._active:
            self._active.remove(active)
        reason = "cancelled" if reason in ("", "shutdown") else reason
        if active.row is not None and not active.row.done:
            try:
                self._batch.leave(active.row, reason)
            except Exception:  # e.g. its drafter's finish: the request is over all the same
                log.exception("a request's row failed to leave the batch")
        elif active.joining is not None:
            active.request.stats.stop_reason = reason

    def _save_if_due(self) -> None:
        if self._unsaved and time.monotonic() - self._last_save >= self._save_interval:
            self._unsaved = False  # a failed save is tried again after the next generation (or at shutdown)
            self._last_save = time.monotonic()
            save_pools(self.spec, self.metrics)

    def _keep_config(self, config: SpeculativeConfig) -> None:
        """Remember ``config`` as recently used; forget the drafters of the least recently used one
        beyond ``max_configs`` (never the server's own configuration, whose pools are saved at shutdown,
        nor one that a request in flight uses)."""
        key = config.key()
        self._configs[key] = config
        self._configs.move_to_end(key)
        in_use = {a.job.config.key() for a in self._active} | {key, self._pinned}
        while len(self._configs) > self._max_configs:
            old = next((k for k in self._configs if k not in in_use), None)
            if old is None:
                break
            self.spec.forget(self._configs.pop(old))  # its drafters, and shared pools no other drafter uses


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

"""A request as the worker sees it (``Job``), and the events the worker sends back to its handler."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from speculum.methods import SpeculativeConfig
from speculum.server.output import Piece
from speculum.server.protocol import ApiError
from speculum.stats import Stats


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


def internal_error() -> ApiError:
    return ApiError(500, "internal error while generating", type="server_error")


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")


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

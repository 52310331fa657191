"""A submitted job's events as the HTTP response: one JSON body, or server-sent events as tokens come.

The handler waits for the job's first event, so that an error found when the generation starts
(a method the server cannot run, the queue's time limit) still gets its status code; only then
does the response begin. A client that leaves cancels its job, whether it waited or streamed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from speculum.server.jobs import Failed, Finished, Job, Tokens
from speculum.server.protocol import Formatter, speculation_stats, timeout_error


class ClientGone(Exception):
    """The client closed the connection while its request waited or ran."""


@dataclass
class Gone:
    """Event: the client has gone (put by ``_watch``)."""


async def respond(
    job: Job, request: Request, fmt: Formatter, prompt_tokens: int, *, stream: bool, include_usage: bool
) -> Response:
    """The response to ``job``, already submitted: the whole completion, or a stream of its chunks."""
    watcher = asyncio.create_task(_watch(job, request))
    try:
        first = await _next_event(job)  # Started or Failed: an error still gets its status code
        if isinstance(first, Failed):
            raise first.error
        if stream:
            watcher.cancel()  # Starlette watches a streaming response's client itself
            return StreamingResponse(
                _sse(job, fmt, prompt_tokens, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return JSONResponse(await _collect(job, fmt, prompt_tokens))
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; the generation is cancelled
    except BaseException:
        job.cancel()
        raise
    finally:
        watcher.cancel()


async def _collect(job: Job, fmt: Formatter, prompt_tokens: int) -> dict:
    parts = []
    while True:
        event = await _next_event(job)
        if isinstance(event, Tokens):
            parts.append("".join(p.text for p in event.pieces))
        elif isinstance(event, Finished):
            return fmt.response("".join(parts), event.finish_reason, _usage(prompt_tokens, event), _stats(event))
        elif isinstance(event, Failed):
            raise event.error


async def _sse(job: Job, fmt: Formatter, prompt_tokens: int, include_usage: bool) -> AsyncIterator[str]:
    # A client that disconnects makes Starlette cancel this generator: ``finally`` cancels the job.
    try:
        if fmt.chat:
            yield _event(fmt.chunk("", role=True))  # OpenAI's first chat chunk announces the role
        while True:
            event = await job.events.get()
            if isinstance(event, Tokens):
                text = "".join(p.text for p in event.pieces)
                yield _event(fmt.chunk(text, speculation=_progress(event)))
            elif isinstance(event, Finished):
                yield _event(fmt.chunk(None, event.finish_reason, speculation=_stats(event)))
                if include_usage:
                    yield _event(fmt.usage_chunk(_usage(prompt_tokens, event)))
                break
            elif isinstance(event, Failed):  # e.g. the time limit: the status line is sent already
                yield _event(event.error.body())
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()  # nothing left to stop when the generation has ended


async def _next_event(job: Job):
    event = await job.events.get()
    if isinstance(event, Gone):
        raise ClientGone
    return event


async def _watch(job: Job, request: Request, every: float = 0.25) -> None:
    """Until cancelled: cancel the job when its client disconnects, or when its time runs out while it
    still waits in the queue (the worker would only notice when it reaches it)."""
    while True:
        await asyncio.sleep(every)
        if await request.is_disconnected():
            job.cancel()
            job.events.put_nowait(Gone())
            return
        if not job.started and job.expired:
            job.cancel("timeout")
            job.events.put_nowait(Failed(timeout_error(job.timeout)))
            return


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _usage(prompt_tokens: int, event: Finished) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": event.num_tokens,
        "total_tokens": prompt_tokens + event.num_tokens,
    }


def _stats(event: Finished) -> dict:
    return speculation_stats(
        event.method, event.stats, time_to_first_token=event.time_to_first_token, queue_time=event.queue_time
    )


def _progress(event: Tokens) -> dict:
    """What a stream chunk says besides its text: each token's text and origin, and the live counts."""
    return {
        "tokens": [{"text": p.text, "source": p.source} for p in event.pieces],
        "num_output_tokens": event.num_output_tokens,
        "num_spec_steps": event.num_spec_steps,
        "num_accepted_tokens": event.num_accepted_tokens,
        "elapsed": round(event.elapsed, 4),
    }

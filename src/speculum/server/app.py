"""The FastAPI app: OpenAI's completions and chat completions (whole or streamed as server-sent
events), /v1/models, /health, /metrics and the live page at /.

``create_app(spec)`` serves an already loaded :class:`~speculum.Speculum`; ``serve`` runs it under
uvicorn (what ``speculum serve`` does). Requests run one at a time per model (see ``worker``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import json
import logging
import secrets
import signal
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from speculum.api import Speculum
from speculum.errors import InvalidInputError, SpeculumError, UnknownMethodError
from speculum.methods import METHODS, SpeculativeConfig
from speculum.server.metrics import Metrics
from speculum.server.protocol import (
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    SERVER_ONLY_PARAMS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    Formatter,
    SamplingFields,
    names_a_file,
    speculation_stats,
    timeout_error,
)
from speculum.server.worker import Failed, Finished, Job, Tokens, Worker, save_pools

log = logging.getLogger("speculum.server")

# A method parameter sent by a client may not exceed max(this, its default): a draft of a million
# tokens or a window of a million columns would only exhaust the server.
MAX_REQUEST_PARAM = 256

# Method parameters that keep a drafter's pool from one request to the next, where every later
# request (of any client) drafts from it.
KEEPS_HISTORY = ("persist", "reuse_history")


@dataclass
class ServerSettings:
    model_name: str | None = None  # the name clients use in "model" (default: the Speculum's name)
    api_key: str | None = None  # when set, every endpoint but /health needs it
    max_queue: int = 128  # requests waiting beyond the running batch; more get 503
    max_batch: int = 16  # requests decoded together (one target forward per step)
    prefill_chunk: int = 256  # prompt tokens prefilled between two decoding steps
    request_timeout: float = 600.0  # seconds from arrival (queueing included) to the last token
    default_max_tokens: int = 256  # when a request names none
    max_tokens_limit: int = 4096  # the most a request may ask for
    max_body_bytes: int = 1 << 20  # a larger request body gets 413
    # Keep drafters' pools across requests (persist, reuse_history, pool_path), shared by every
    # client; off: each request drafts only from its own prompt and output.
    share_pools: bool = False
    pool_save_interval: float = 60.0  # seconds between saves of pools with a pool_path (and at shutdown)
    max_configs: int = 16  # method configurations whose drafters are kept (the server's own always)


def server_config(config: SpeculativeConfig, share_pools: bool) -> SpeculativeConfig:
    """``config`` as the server runs it: unchanged with ``share_pools``; otherwise with every pool kept
    for one request only. A configuration that asks to keep one (persist, reuse_history, pool_path)
    needs ``share_pools``: InvalidInputError otherwise."""
    if share_pools:
        return config
    asked = [name for name in (*KEEPS_HISTORY, "pool_path") if config.params.get(name) not in (None, False)]
    if asked:
        raise InvalidInputError(
            f"{asked[0]} keeps a pool of every request's text for later requests, shared by all clients; "
            "this server keeps pools per request (speculum serve --share-pools shares them)"
        )
    options = config.options()
    per_request = {name: False for name in KEEPS_HISTORY if getattr(options, name, False)}
    return SpeculativeConfig.coerce(config, **per_request) if per_request else config


def create_app(spec: Speculum, settings: ServerSettings | None = None, *, worker_thread: bool = True) -> FastAPI:
    """The app serving ``spec``; its worker runs the requests in a thread of its own started with the
    app, or with ``worker_thread=False`` wherever ``app.state.worker.run()`` is called (see ``serve``)."""
    settings = settings or ServerSettings()
    model_name = settings.model_name or spec.name or "speculum"
    default = server_config(spec.default_config, settings.share_pools)  # what requests naming no method run
    metrics = Metrics()
    worker = Worker(
        spec,
        metrics,
        settings.max_queue,
        max_batch=settings.max_batch,
        prefill_chunk=settings.prefill_chunk,
        max_configs=settings.max_configs,
        default_config=default,
        save_interval=settings.pool_save_interval,
    )
    page = (resources.files("speculum.server") / "static" / "index.html").read_text(encoding="utf-8")
    started_at = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if worker_thread:
            worker.start()
        yield
        await run_in_threadpool(worker.stop)
        for path in save_pools(spec, metrics):
            log.info("saved pool %s", path)

    app = FastAPI(title="speculum", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker = worker
    app.state.metrics = metrics
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes, metrics=metrics)
    if settings.api_key:  # added last: runs first, so a client without the key gets 401 before any reading
        app.add_middleware(ApiKeyMiddleware, key=settings.api_key, metrics=metrics)

    # ------------------------------------------------------------------ errors: OpenAI's body, never a traceback

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        if exc.code in ("queue_full", "shutting_down"):
            metrics.rejected.labels(exc.code).inc()
        elif 400 <= exc.status < 500:
            metrics.rejected.labels("invalid").inc()
        return JSONResponse(exc.body(), exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return await api_error(request, _validation_api_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        error = ApiError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}", code=code)
        return JSONResponse(error.body(), exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return JSONResponse(ApiError(500, "internal server error", type="server_error").body(), 500)

    # ------------------------------------------------------------------ endpoints

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> dict:
        params = {k: v for k, v in default.all_params().items() if k not in SERVER_ONLY_PARAMS}
        card = {
            "id": model_name,
            "object": "model",
            "created": started_at,
            "owned_by": "speculum",
            "max_model_len": spec.runner.max_positions,
            "chat_template": bool(getattr(spec.tokenizer, "chat_template", None)),  # /v1/chat/completions works
            "speculation": {
                "default": {"method": default.method, **params},
                "methods": list(METHODS),
                "draft": spec.draft_name,
            },
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):  # a list of one string
            prompt = prompt[0]
        prompt_ids = await _encode(prompt, "prompt")
        return await _generate(body, body.max_tokens, prompt_ids, request, Formatter(chat=False, model=model_name))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        prompt_ids = await _encode(messages, "messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await _generate(body, max_tokens, prompt_ids, request, Formatter(chat=True, model=model_name))

    # ------------------------------------------------------------------ the request's way through

    async def _encode(prompt, param: str) -> list[int]:
        try:
            ids = await run_in_threadpool(spec.encode_prompt, prompt)
        except InvalidInputError as exc:
            raise ApiError(400, str(exc), param=param) from None
        except Exception as exc:  # the tokenizer's chat template refused the messages (a jinja error)
            if param != "messages":
                raise
            raise ApiError(400, f"the chat template could not render the messages: {exc}", param=param) from None
        context = spec.runner.max_positions
        if context is not None and len(ids) >= context:
            raise ApiError(
                400,
                f"the prompt has {len(ids)} tokens; this model's context is {context} tokens",
                param=param,
                code="context_length_exceeded",
            )
        return ids

    async def _generate(body: SamplingFields, max_tokens, prompt_ids, request: Request, fmt: Formatter) -> Response:
        if body.model is not None and body.model != model_name:
            message = f"the model {body.model!r} does not exist; this server serves {model_name!r}"
            raise ApiError(404, message, param="model", code="model_not_found")
        if max_tokens is None:
            max_tokens = settings.default_max_tokens
        if max_tokens > settings.max_tokens_limit:
            raise ApiError(400, f"max_tokens may be at most {settings.max_tokens_limit}", param="max_tokens")
        job = Job(
            prompt_ids=prompt_ids,
            config=_request_config(default, body.speculative_config, settings.share_pools),
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(0, body.top_k),
            seed=body.seed,
            stop=body.stop_strings(),
            timeout=settings.request_timeout,
            loop=asyncio.get_running_loop(),
        )
        worker.submit(job)
        watcher = asyncio.create_task(_watch(job, request))
        try:
            first = await _next_event(job)  # Started or Failed: an error still gets its status code
            if isinstance(first, Failed):
                raise first.error
            if body.stream:
                watcher.cancel()  # Starlette watches a streaming response's client itself
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                return StreamingResponse(
                    _sse(job, fmt, len(prompt_ids), include_usage),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            return JSONResponse(await _collect(job, fmt, len(prompt_ids)))
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

    return app


class ClientGone(Exception):
    """The client closed the connection while its request waited or ran."""


@dataclass
class Gone:
    """Event: the client has gone (put by ``_watch``)."""


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


def _request_config(default: SpeculativeConfig, raw: dict[str, Any] | None, share_pools: bool) -> SpeculativeConfig:
    """The method a request asked for: the server's own configuration (and its pools) when it names
    no parameter, else the method's defaults with the request's parameters on top."""
    params = dict(raw or {})
    method = params.pop("method", default.method)
    if method == default.method and not params:
        return default
    if not isinstance(method, str) or SpeculativeConfig.is_file_reference(method):
        raise ApiError(400, "speculative_config.method must be a method name", param="speculative_config.method")
    for name, value in params.items():
        if names_a_file(name, value):
            raise ApiError(
                400,
                f"{name} names a file on the server: set it with speculum serve --param, not per request",
                param=f"speculative_config.{name}",
            )
        if isinstance(value, (dict, list)):
            raise ApiError(400, f"{name} must be a number, a boolean or a string", param=f"speculative_config.{name}")
    try:
        defaults = {f.name: f.default for f in dataclasses.fields(SpeculativeConfig(method).options())}
    except UnknownMethodError as exc:
        raise ApiError(400, str(exc), param="speculative_config.method", code="unknown_method") from None
    # before the method's own checks, so that the error names the parameter that is too large
    for name, value in params.items():
        default_value = defaults.get(name)
        limit = max(MAX_REQUEST_PARAM, default_value if isinstance(default_value, int) else 0)
        if isinstance(value, int) and not isinstance(value, bool) and value > limit:
            raise ApiError(400, f"{name} may be at most {limit} here", param=f"speculative_config.{name}")
    try:
        config = SpeculativeConfig.coerce(method, **params)
    except InvalidInputError as exc:
        raise ApiError(400, str(exc), param="speculative_config") from None
    try:
        return server_config(config, share_pools)
    except InvalidInputError as exc:
        name = next(n for n in (*KEEPS_HISTORY, "pool_path") if n in params)
        raise ApiError(400, str(exc), param=f"speculative_config.{name}") from None


def _validation_api_error(exc: RequestValidationError) -> ApiError:
    """FastAPI's 422 as OpenAI's 400, naming the field."""
    error = exc.errors()[0]
    # drop "body" and pydantic's union-member tags ("str", "list[int]", ...) from the location
    loc = [str(p) for p in error.get("loc", ()) if p != "body" and not _is_type_tag(p)]
    param = ".".join(loc) or None
    kind = error.get("type", "")
    if kind == "json_invalid":
        detail = error.get("ctx", {}).get("error", "")
        return ApiError(400, f"the request body is not valid JSON ({detail})", code="invalid_json")
    if kind == "extra_forbidden":
        return ApiError(400, f"unknown or unsupported field {param!r}", param=param, code="unknown_field")
    if kind == "missing":
        what = f"the field {param!r} is required" if param else "the request needs a JSON object body"
        return ApiError(400, what, param=param)
    if not param:
        return ApiError(400, "the request body must be a JSON object (sent as Content-Type: application/json)")
    top = loc[0]
    if top in UNION_FIELDS and sum(1 for e in exc.errors() if top in e.get("loc", ())) > 1:
        return ApiError(400, f"{top} must be {UNION_FIELDS[top]}", param=top)
    return ApiError(400, f"{param}: {error.get('msg', 'invalid value')}", param=param)


# fields with several accepted shapes: pydantic reports one error per shape, we say what is accepted
UNION_FIELDS = {
    "prompt": "a string, a list of token ids or a list of one string",
    "stop": f"a string of 1 to {MAX_STOP_LENGTH} characters or a list of at most {MAX_STOP_STRINGS} such strings",
    "content": "a string or a list of text parts",
}


def _is_type_tag(part) -> bool:
    """pydantic's names of union members in an error location (str, list[int], constrained-str...)."""
    return isinstance(part, str) and (
        "[" in part or part.startswith("constrained-") or part in {"str", "int", "float", "bool", "list", "dict"}
    )


class BodyLimitMiddleware:
    """A request body over ``limit`` bytes gets 413 before anything parses it: at once when its
    Content-Length says so, else as soon as the bytes read pass the limit. A body within it is
    handed on whole."""

    def __init__(self, app, limit: int, metrics: Metrics):
        self.app = app
        self.limit = limit
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            await self._refuse(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._refuse(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        pending = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay():  # the body once, then what the client does next (a disconnect)
            nonlocal pending
            if pending is None:
                return await receive()
            whole, pending = pending, None
            return whole

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send) -> None:
        self.metrics.rejected.labels("too_large").inc()
        message = f"the request body is larger than this server's limit of {self.limit} bytes (--max-body-bytes)"
        error = ApiError(413, message, code="request_too_large")
        await JSONResponse(error.body(), 413)(scope, receive, send)


class ApiKeyMiddleware:
    """Every path but /health needs ``Authorization: Bearer KEY`` (or HTTP Basic with KEY as the
    password, which lets a browser open the page: the browser asks once and resends it on fetches)."""

    def __init__(self, app, key: str, metrics: Metrics):
        self.app = app
        self.key = key.encode()
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health" or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        self.metrics.rejected.labels("unauthorized").inc()
        error = ApiError(401, "missing or wrong API key: send Authorization: Bearer <key>", code="invalid_api_key")
        challenge = 'Basic realm="speculum"' if scope["path"] == "/" else "Bearer"
        response = JSONResponse(error.body(), 401, headers={"WWW-Authenticate": challenge})
        await response(scope, receive, send)

    def _authorized(self, scope) -> bool:
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, value = header.partition(b" ")
        if scheme.lower() == b"bearer":
            given = value.strip()
        elif scheme.lower() == b"basic":
            try:
                given = base64.b64decode(value.strip(), validate=True).partition(b":")[2]
            except (binascii.Error, ValueError):
                return False
        else:
            return False
        return secrets.compare_digest(given, self.key)


def serve(
    spec: Speculum,
    settings: ServerSettings | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    sockets=None,
    log_level: str = "info",
) -> None:
    """Run the app under uvicorn until interrupted (Ctrl-C / SIGTERM); pools with a path are saved then."""
    import uvicorn

    app = create_app(spec, settings, worker_thread=False)
    # a streaming request still running at shutdown gets 5 s, then is cancelled (its pools still saved)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    # The model runs in this thread, the one that loaded it (see Worker.run); HTTP in another. A
    # signal reaches this thread: the first asks uvicorn to shut down gracefully (its shutdown stops
    # the worker, which ends the loop below), a second one forces it.
    http = threading.Thread(target=server.run, kwargs={"sockets": sockets}, name="speculum-http", daemon=True)

    def on_signal(signum, frame) -> None:
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        http.start()
        app.state.worker.run(alive=http.is_alive)
        http.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        raise SpeculumError(f"the server could not start on {host}:{port} (see the log above)")

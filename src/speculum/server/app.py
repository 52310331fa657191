"""The FastAPI app: OpenAI's completions and chat completions (whole or streamed as server-sent
events), /v1/models, /health, /metrics and the live page at /.

``create_app(spec)`` serves an already loaded :class:`~speculum.Speculum`; ``serve`` runs it under
uvicorn (what ``speculum serve`` does). One worker per model runs the requests as rows of one batch
(see ``worker``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from speculum.api import Speculum
from speculum.errors import InvalidInputError, SpeculumError
from speculum.methods import METHODS, SpeculativeConfig
from speculum.server.jobs import Job
from speculum.server.metrics import Metrics
from speculum.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from speculum.server.protocol import (
    SERVER_ONLY_PARAMS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    Formatter,
    SamplingFields,
)
from speculum.server.responses import respond
from speculum.server.validation import request_config, server_config, validation_api_error
from speculum.server.worker import Worker, save_pools

log = logging.getLogger("speculum.server")


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


def create_app(spec: Speculum, settings: ServerSettings | None = None, *, worker_thread: bool = True) -> FastAPI:
    """The app serving ``spec``; its worker runs the requests in a thread of its own started with the
    app, or with ``worker_thread=False`` wherever ``app.state.worker.run()`` is called (see ``serve``)."""
    settings = settings or ServerSettings()
    served = Served.build(spec, settings)
    app = FastAPI(
        title="speculum", lifespan=_lifespan(served, worker_thread), docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.worker = served.worker
    app.state.metrics = served.metrics
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes, metrics=served.metrics)
    if settings.api_key:  # added last: runs first, so a client without the key gets 401 before any reading
        app.add_middleware(ApiKeyMiddleware, key=settings.api_key, metrics=served.metrics)
    _add_error_handlers(app, served.metrics)
    _add_routes(app, served)
    return app


@dataclass
class Served:
    """What the handlers serve: the model under the name clients use, the configuration that requests
    naming no method run, and the worker that runs every request."""

    spec: Speculum
    settings: ServerSettings
    model_name: str
    default: SpeculativeConfig
    metrics: Metrics
    worker: Worker
    page: str  # the live page's HTML
    started_at: int

    @classmethod
    def build(cls, spec: Speculum, settings: ServerSettings) -> Served:
        default = server_config(spec.default_config, settings.share_pools)
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
        model_name = settings.model_name or spec.name or "speculum"
        return cls(spec, settings, model_name, default, metrics, worker, page, int(time.time()))

    def model_card(self) -> dict:
        """The one model of /v1/models, with what it speculates by default and what it can run."""
        params = {k: v for k, v in self.default.all_params().items() if k not in SERVER_ONLY_PARAMS}
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.started_at,
            "owned_by": "speculum",
            "max_model_len": self.spec.runner.max_positions,
            "chat_template": bool(getattr(self.spec.tokenizer, "chat_template", None)),  # /v1/chat/completions works
            "speculation": {
                "default": {"method": self.default.method, **params},
                "methods": list(METHODS),
                "draft": self.spec.draft_name,
            },
        }

    async def encode(self, prompt, param: str) -> list[int]:
        """The prompt's token ids; ApiError 400 naming ``param`` when it cannot be encoded or is too long."""
        try:
            ids = await run_in_threadpool(self.spec.encode_prompt, prompt)
        except InvalidInputError as exc:
            raise ApiError(400, str(exc), param=param) from None
        except Exception as exc:  # the tokenizer's chat template refused the messages (a jinja error)
            if param != "messages":
                raise
            raise ApiError(400, f"the chat template could not render the messages: {exc}", param=param) from None
        context = self.spec.runner.max_positions
        if context is not None and len(ids) >= context:
            raise ApiError(
                400,
                f"the prompt has {len(ids)} tokens; this model's context is {context} tokens",
                param=param,
                code="context_length_exceeded",
            )
        return ids

    async def generate(
        self, body: SamplingFields, max_tokens: int | None, prompt_ids: list[int], request: Request, fmt: Formatter
    ) -> Response:
        """Queue the request's generation and answer with it, whole or streamed."""
        job = self._job(body, max_tokens, prompt_ids)
        self.worker.submit(job)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await respond(job, request, fmt, len(prompt_ids), stream=body.stream, include_usage=include_usage)

    def _job(self, body: SamplingFields, max_tokens: int | None, prompt_ids: list[int]) -> Job:
        settings = self.settings
        if body.model is not None and body.model != self.model_name:
            message = f"the model {body.model!r} does not exist; this server serves {self.model_name!r}"
            raise ApiError(404, message, param="model", code="model_not_found")
        if max_tokens is None:
            max_tokens = settings.default_max_tokens
        if max_tokens > settings.max_tokens_limit:
            raise ApiError(400, f"max_tokens may be at most {settings.max_tokens_limit}", param="max_tokens")
        return Job(
            prompt_ids=prompt_ids,
            config=request_config(self.default, body.speculative_config, settings.share_pools),
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(0, body.top_k),
            seed=body.seed,
            stop=body.stop_strings(),
            timeout=settings.request_timeout,
            loop=asyncio.get_running_loop(),
        )


def _lifespan(served: Served, worker_thread: bool):
    """Starts the worker with the app (unless the caller runs it), stops it at shutdown and saves the pools."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if worker_thread:
            served.worker.start()
        yield
        await run_in_threadpool(served.worker.stop)
        for path in save_pools(served.spec, served.metrics):
            log.info("saved pool %s", path)

    return lifespan


def _add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Every error is answered with OpenAI's error body, never a traceback."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        if exc.code in ("queue_full", "shutting_down"):
            metrics.rejected.labels(exc.code).inc()
        elif 400 <= exc.status < 500:
            metrics.rejected.labels("invalid").inc()
        return JSONResponse(exc.body(), exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return await api_error(request, validation_api_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        error = ApiError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}", code=code)
        return JSONResponse(error.body(), exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return JSONResponse(ApiError(500, "internal server error", type="server_error").body(), 500)


def _add_routes(app: FastAPI, served: Served) -> None:
    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        return HTMLResponse(served.page)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(served.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [served.model_card()]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):  # a list of one string
            prompt = prompt[0]
        prompt_ids = await served.encode(prompt, "prompt")
        return await served.generate(
            body, body.max_tokens, prompt_ids, request, Formatter(chat=False, model=served.model_name)
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        prompt_ids = await served.encode(messages, "messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await served.generate(
            body, max_tokens, prompt_ids, request, Formatter(chat=True, model=served.model_name)
        )


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

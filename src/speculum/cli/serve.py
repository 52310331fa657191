"""``speculum serve``: the OpenAI-compatible HTTP server (:mod:`speculum.server`) over one loaded model."""

from __future__ import annotations

from typing import Annotated

import typer

from speculum.cli.common import (
    DEFAULT_MODEL,
    DeviceOption,
    DraftDeviceOption,
    DraftOption,
    DtypeOption,
    ExactOption,
    GgufFileOption,
    ModelOption,
    PrepackOption,
    QuantizationOption,
    err,
    fail,
    load_models,
    parse_params,
    resolve_config,
)
from speculum.errors import SpeculumError


def serve(
    model: ModelOption = None,
    draft: DraftOption = None,
    method: Annotated[
        str | None,
        typer.Option(help="The method of requests that name none (each request may pick its own). [default: auto]"),
    ] = None,
    config: Annotated[str | None, typer.Option(help="A config file from `speculum tune --out`.")] = None,
    param: Annotated[
        list[str] | None,
        typer.Option(help="Method parameter key=value (repeatable); pool_path=FILE keeps the pool across restarts."),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to bind; loopback by default.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535)] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="SPECULUM_API_KEY", help="Every endpoint but /health then needs 'Authorization: Bearer KEY'."
        ),
    ] = None,
    served_model_name: Annotated[str | None, typer.Option(help="The name clients send as 'model'.")] = None,
    max_queue: Annotated[int, typer.Option(min=1, help="Requests that may wait; more get 503 + Retry-After.")] = 128,
    max_batch: Annotated[
        int, typer.Option(min=1, help="Requests decoded together, one target forward per step for all of them.")
    ] = 16,
    prefill_chunk: Annotated[
        int, typer.Option(min=1, help="Prompt tokens prefilled between two decoding steps.")
    ] = 256,
    request_timeout: Annotated[
        float, typer.Option(min=0.1, help="Seconds a request may take, queueing included.")
    ] = 600.0,
    max_tokens: Annotated[int, typer.Option(min=1, help="The most tokens a request may ask for.")] = 4096,
    max_body_bytes: Annotated[int, typer.Option(min=1, help="The largest request body; larger get 413.")] = 1048576,
    share_pools: Annotated[
        bool,
        typer.Option(
            help="Keep drafters' pools across requests (persist, reuse_history, pool_path), shared by every "
            "client: one client's statistics may then show what another's requests generated. "
            "Off: each request drafts from its own text only."
        ),
    ] = False,
    pool_save_interval: Annotated[
        float, typer.Option(min=0.0, help="Seconds between saves of pools with a pool_path (and at shutdown).")
    ] = 60.0,
    dtype: DtypeOption = "auto",
    device: DeviceOption = "cpu",
    draft_device: DraftDeviceOption = None,
    gguf_file: GgufFileOption = None,
    prepack: PrepackOption = True,
    exact: ExactOption = "auto",
    quantization: QuantizationOption = "auto",
    log_level: Annotated[str, typer.Option(help="uvicorn's log level.")] = "info",
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (streaming, speculation statistics) with a
    live page at /. Up to --max-batch requests decode together (continuous batching: a request joins
    the running batch between two steps); the others wait in a bounded queue."""
    try:
        from speculum.server import ServerSettings, server_config
        from speculum.server import serve as run_server
    except ImportError as error:
        fail(f"speculum serve needs the server extra: pip install 'speculum[server]' ({error})")
    try:
        spec_config, model, draft = resolve_config(method, config, parse_params(param or []), model, draft)
        server_config(spec_config, share_pools)  # refuses persistent pools without --share-pools, before loading
        model = model or DEFAULT_MODEL
        if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
            err.print(
                f"[yellow]warning:[/yellow] serving on {host} without --api-key: anyone who reaches it may use it"
            )
        spec = load_models(
            model,
            draft,
            dtype=dtype,
            device=device,
            draft_device=draft_device,
            gguf_file=gguf_file,
            prepack=prepack,
            exact=exact,
            quantization=quantization,
        )
        spec.default_config = spec_config
        settings = ServerSettings(
            model_name=served_model_name or model,
            api_key=api_key or None,
            max_queue=max_queue,
            max_batch=max_batch,
            prefill_chunk=prefill_chunk,
            request_timeout=request_timeout,
            max_tokens_limit=max_tokens,
            default_max_tokens=min(256, max_tokens),
            max_body_bytes=max_body_bytes,
            share_pools=share_pools,
            pool_save_interval=pool_save_interval,
        )
        err.print(f"speculum serve: {model} ({spec_config!r}) on http://{host}:{port}/", highlight=False)
        run_server(spec, settings, host=host, port=port, log_level=log_level)
    except SpeculumError as error:
        fail(str(error))

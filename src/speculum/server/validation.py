"""What a request may ask for: its method configuration as the server runs it, and FastAPI's validation
errors as OpenAI's 400 naming the field."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi.exceptions import RequestValidationError

from speculum.errors import InvalidInputError, UnknownMethodError
from speculum.methods import SpeculativeConfig
from speculum.server.protocol import MAX_STOP_LENGTH, MAX_STOP_STRINGS, ApiError, names_a_file

# A method parameter sent by a client may not exceed max(this, its default): a draft of a million
# tokens or a window of a million columns would only exhaust the server.
MAX_REQUEST_PARAM = 256

# Method parameters that keep a drafter's pool from one request to the next, where every later
# request (of any client) drafts from it.
KEEPS_HISTORY = ("persist", "reuse_history")


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


def request_config(default: SpeculativeConfig, raw: dict[str, Any] | None, share_pools: bool) -> SpeculativeConfig:
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


def validation_api_error(exc: RequestValidationError) -> ApiError:
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

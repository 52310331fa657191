"""ASGI middleware that refuses a request before FastAPI reads it: a body over the size limit, a
missing or wrong API key."""

from __future__ import annotations

import base64
import binascii
import secrets

from fastapi.responses import JSONResponse

from speculum.server.metrics import Metrics
from speculum.server.protocol import ApiError


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

"""Refuse request bodies over a size limit before they are read whole (HTTP 413)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orpheus_common.http import error_response


class BodyLimitMiddleware:
    """Pure ASGI: checks Content-Length up front, then reads the body chunk by chunk and stops
    at the limit. The (small, bounded) body is replayed to the app, whose later receive()
    calls (disconnect watching) go to the client as usual."""

    def __init__(self, app: ASGIApp, max_bytes: int, larger: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.larger = larger or {}  # path -> its own limit (an upload's)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.larger.get(scope["path"], self.max_bytes)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(scope, receive, send, limit)
            return
        body = await self._read_bounded(receive, limit)
        if body is None:
            await self._refuse(scope, receive, send, limit)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read_bounded(self, receive: Receive, limit: int) -> bytes | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        refusal = error_response(413, f"request body over {limit} bytes", code="body_too_large")
        await refusal(scope, receive, send)

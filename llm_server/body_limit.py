"""Refuse request bodies over a size limit before they are read whole (HTTP 413)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orpheus_common.http import error_response


class BodyLimitMiddleware:
    """Pure ASGI: checks Content-Length up front, then reads the body chunk by chunk and stops
    at the limit. The (small, bounded) body is replayed to the app, whose later receive()
    calls (disconnect watching) go to the client as usual."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        body = await self._read_bounded(receive)
        if body is None:
            await self._refuse(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read_bounded(self, receive: Receive) -> bytes | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = error_response(413, f"request body over {self.max_bytes} bytes", code="body_too_large")
        await refusal(scope, receive, send)

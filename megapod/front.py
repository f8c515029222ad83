"""The MegaPod's single endpoint: each speech request or socket goes to the worker with the fewest
active streams; a worker at its cap (429) passes an HTTP request to the next one.

Every front door is relayed: OpenAI's POST /v1/audio/speech, the Cartesia- and Deepgram-compatible
WebSockets (/tts/websocket, /v1/speak) both ways, message by message, and their HTTP twins (POST
/tts/bytes, /v1/speak), query strings included. Responses stream as they come. A client that
disconnects closes the upstream request or socket at once, so the worker aborts generation. API
keys are the workers' business: the front passes the headers each protocol authenticates with
(`Authorization`, `X-API-Key`) and `X-Request-Id`, and relays refusals as they are.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from starlette.websockets import WebSocketDisconnect
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from llm_server.errors import error_response
from llm_server.ws_util import TRY_AGAIN_LATER

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 65536
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive"}
# Request headers the workers act on: the API key (each protocol's way), and the id their log lines carry.
_PASSED_HEADERS = ("authorization", "x-api-key", "x-request-id")
SPEECH_POSTS = ("/v1/audio/speech", "/tts/bytes", "/v1/speak")
SOCKETS = ("/tts/websocket", "/v1/speak")


class WorkerPool:
    """Active stream counts per worker; picks least active, rotating among ties."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.active = {u: 0 for u in urls}
        self._turn = itertools.count()

    def order(self) -> list[str]:
        """Workers to try, least active first (ties rotate so load spreads when all are idle)."""
        start = next(self._turn) % len(self.urls)
        rotated = self.urls[start:] + self.urls[:start]
        return sorted(rotated, key=lambda u: self.active[u])


def create_front_app(worker_urls: list[str]) -> FastAPI:
    """The front app over the given worker base URLs (http://host:port)."""
    pool = WorkerPool(worker_urls)
    registry = CollectorRegistry()
    active = Gauge("megapod_front_active_streams", "Streams relayed, per worker", ["worker"], registry=registry)
    routed = Counter("megapod_front_requests", "Speech requests by worker and status", ["worker", "status"], registry=registry)
    client = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None))
    app = FastAPI(title="Orpheus MegaPod front")
    app.state.pool = pool

    async def speech(request: Request) -> Response:
        body = await _bounded_body(request)
        if body is None:
            return error_response(413, f"request body over {MAX_BODY_BYTES} bytes")
        headers = {"content-type": request.headers.get("content-type", "application/json"), **_passed(request)}
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        for url in pool.order():
            try:
                upstream = await client.send(client.build_request("POST", f"{url}{target}", content=body, headers=headers), stream=True)
            except httpx.HTTPError as exc:
                log.warning("worker %s unreachable: %s", url, exc)
                continue
            routed.labels(url, str(upstream.status_code)).inc()
            if upstream.status_code == 429:
                await upstream.aclose()
                continue
            return _relay(upstream, url, pool, active, request)
        return error_response(429, "every worker is at its stream limit; retry shortly", code="rate_limit_exceeded",
                              headers={"Retry-After": "1"})

    async def socket(ws: WebSocket) -> None:
        await _relay_socket(ws, pool, active)

    for path in SPEECH_POSTS:
        app.add_api_route(path, speech, methods=["POST"])
    for path in SOCKETS:
        app.add_api_websocket_route(path, socket)

    @app.get("/v1/voices")
    async def voices(request: Request) -> Response:
        return await _forward_get(client, pool, "/v1/voices", _passed(request))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await _forward_get(client, pool, "/v1/models", _passed(request))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        for url in pool.urls:
            try:
                if (await client.get(f"{url}/ready", timeout=2.0)).status_code == 200:
                    return JSONResponse({"status": "ready"})
            except httpx.HTTPError:
                pass
        return error_response(503, "no worker is ready", code="not_ready")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _bounded_body(request: Request) -> bytes | None:
    """The request body, or None as soon as it grows past MAX_BODY_BYTES (never read whole)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _passed(request: Request) -> dict[str, str]:
    return {name: request.headers[name] for name in _PASSED_HEADERS if name in request.headers}


async def _forward_get(client: httpx.AsyncClient, pool: WorkerPool, path: str, headers: dict[str, str]) -> Response:
    for url in pool.order():
        try:
            reply = await client.get(f"{url}{path}", headers=headers, timeout=5.0)
        except httpx.HTTPError:
            continue
        relayed = {k: v for k, v in reply.headers.items() if k.lower() in ("www-authenticate", "x-request-id", "retry-after")}
        return Response(reply.content, reply.status_code, headers=relayed, media_type=reply.headers.get("content-type"))
    return error_response(503, "no worker reachable")


def _relay(upstream: httpx.Response, url: str, pool: WorkerPool, active: Gauge, request: Request) -> StreamingResponse:
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}
    headers["x-megapod-worker"] = url
    pool.active[url] += 1
    active.labels(url).inc()

    async def stream() -> AsyncIterator[bytes]:
        watcher = asyncio.create_task(_close_on_disconnect(request, upstream))
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            watcher.cancel()
            await upstream.aclose()
            pool.active[url] -= 1
            active.labels(url).dec()

    return StreamingResponse(stream(), status_code=upstream.status_code, headers=headers)


async def _close_on_disconnect(request: Request, upstream: httpx.Response) -> None:
    """The client left: close the upstream request now so the worker aborts generation."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    await upstream.aclose()


async def _relay_socket(ws: WebSocket, pool: WorkerPool, active: Gauge) -> None:
    """One client socket to the least active worker's, message by message both ways; either side's
    close closes the other (a worker's 1013 reaches the client as 1013)."""
    target = ws.url.path + (f"?{ws.url.query}" if ws.url.query else "")
    headers = {name: ws.headers[name] for name in _PASSED_HEADERS if name in ws.headers}
    for url in pool.order():
        try:
            upstream = await connect("ws" + url.removeprefix("http") + target, additional_headers=headers)
        except InvalidStatus:  # the worker refused the handshake (a missing or unknown key): so does the front
            await ws.close(1008)
            return
        except OSError as exc:
            log.warning("worker %s unreachable: %s", url, exc)
            continue
        break
    else:
        await ws.accept()
        await ws.close(TRY_AGAIN_LATER, "no worker reachable")
        return
    await ws.accept()
    pool.active[url] += 1
    active.labels(url).inc()
    try:
        await _pump_both_ways(ws, upstream)
    finally:
        pool.active[url] -= 1
        active.labels(url).dec()


async def _pump_both_ways(ws: WebSocket, upstream) -> None:
    async def client_to_worker() -> None:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            await upstream.send(message["text"] if message.get("text") is not None else message["bytes"])

    async def worker_to_client() -> None:
        async for message in upstream:
            if isinstance(message, str):
                await ws.send_text(message)
            else:
                await ws.send_bytes(message)

    tasks = [asyncio.create_task(client_to_worker()), asyncio.create_task(worker_to_client())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        code = upstream.close_code or 1000
        await upstream.close()
        try:
            await ws.close(code)
        except (RuntimeError, WebSocketDisconnect, ConnectionClosed):
            pass

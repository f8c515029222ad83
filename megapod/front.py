"""The MegaPod's single HTTP endpoint: each speech request goes to the worker with the fewest
active streams; a worker at its cap (429) passes the request to the next one.

Responses are relayed as they stream. A client that disconnects closes the upstream
request at once, so the worker aborts its engine request. API keys are the workers' business:
the front passes `Authorization` (and `X-Request-Id`) through and relays their 401s as they are.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from llm_server.errors import error_response

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 65536
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive"}
# Request headers the workers act on: the API key, and the id their log lines carry.
_PASSED_HEADERS = ("authorization", "x-request-id")


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

    @app.post("/v1/audio/speech")
    async def speech(request: Request) -> Response:
        body = await _bounded_body(request)
        if body is None:
            return error_response(413, f"request body over {MAX_BODY_BYTES} bytes")
        headers = {"content-type": request.headers.get("content-type", "application/json"), **_passed(request)}
        for url in pool.order():
            try:
                upstream = await client.send(client.build_request("POST", f"{url}/v1/audio/speech", content=body, headers=headers), stream=True)
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

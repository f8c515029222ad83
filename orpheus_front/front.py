"""The MegaPod's single endpoint: each speech request or socket goes to the worker with the most free
capacity (each worker's replies say how many more streams it would admit: its measured limit less its
active streams), then the fewest active streams; a worker at its limit (429) passes an HTTP request to
the next one.

Every front door is relayed: OpenAI's POST /v1/audio/speech, the WebSockets (Cartesia's /tts/websocket,
Deepgram's /v1/speak, ElevenLabs' /v1/text-to-speech/{voice}/multi-stream-input and /stream-input, Baseten's
/environments/{env}/websocket, Together's /v1/audio/speech/websocket, vLLM-Omni's /v1/audio/speech/stream, SLNG's
/v1/bridges/unmute/tts/{model}) both ways, message by message, and the HTTP twins (POST /tts/bytes, /v1/speak,
/v1/text-to-speech/{voice}[/stream[/with-timestamps]], /environments/{env}/predict), query strings included; the
voice lists (GET /v1/voices, Cartesia's GET /voices) from any worker. Responses stream as they
come. A client that disconnects closes the upstream request or socket at once, so the worker aborts
generation. API keys are the workers' business: the front passes the headers each protocol
authenticates with (`Authorization`, `X-API-Key`, `xi-api-key`) and `X-Request-Id`, and relays refusals
as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import itertools
import json
import logging
import math
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from urllib.parse import unquote

import anyio
import httpx
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict
from starlette.websockets import WebSocketDisconnect
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from orpheus_common import connections
from orpheus_common.http import (
    ADMISSION_WAIT,
    CAPACITY_FREE,
    LOADED_VOICES,
    RETRY_COUNT,
    TRY_AGAIN_LATER,
    error_response,
    voices_of_header,
    whole_number,
)
from orpheus_common.loop_lag import LoopLag
from orpheus_common.playground import playground
from orpheus_common.socket_budget import POLICY_VIOLATION, SocketBudget, SocketLimits
from orpheus_common.tls import TlsSettings

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 65536
# POST /v1/voices: a clone's reference recording (a worker's own limit, max_reference_bytes, is 16 MiB), and how
# long a worker may take to decode and encode it.
VOICE_UPLOAD_BYTES = (16 << 20) + (64 << 10)
VOICE_TIMEOUT_S = 120.0
# Reply headers a worker sends that stop here: hop-by-hop ones, and its free capacity (the front's to read).
_NOT_RELAYED = {"content-length", "transfer-encoding", "connection", "keep-alive", CAPACITY_FREE}
# Request headers the workers act on: the API key (each protocol's way), the id their log lines carry, and the
# client's count of its retries (their admission queues' order).
_PASSED_HEADERS = ("authorization", "x-api-key", "xi-api-key", "x-request-id", RETRY_COUNT)
POOL_WAIT_S = 10.0  # a stream past max_streams waits this long for a connection, then gets a 503
# A worker that vanished without closing (node lost) drops packets: a short connect timeout moves a new
# stream on to the next worker soon. But a connect also times out when this process gets no CPU for
# that long (a starved event loop misses the answer): such workers are tried once more, slowly, last.
CONNECT_S = 2.0
SLOW_CONNECT_S = 10.0
# No read timeout: a stream's reply lasts as long as its audio.
TIMEOUT = httpx.Timeout(10.0, connect=CONNECT_S, read=None, pool=POOL_WAIT_S)
SLOW_TIMEOUT = httpx.Timeout(10.0, connect=SLOW_CONNECT_S, read=None, pool=POOL_WAIT_S)
REFUSAL_READ_S = 2.0  # a worker's 429 body (a few hundred bytes) is read within this, else dropped
KEEPALIVE = 20  # idle connections kept to the workers (httpx's default)
# A relayed socket's budget: twice a worker's default, so that the worker refuses first, in the door's protocol;
# the front only drops a flood the worker has not stopped, and closes it (orpheus_common/socket_budget.py).
RELAY_LIMITS = SocketLimits(messages_per_s=400.0, message_burst=2000.0, bytes_per_s=512 * 1024.0,
                            byte_burst=2048 * 1024.0, patience_s=1.0)
# Sockets whose protocol carries a whole recording in one message (vLLM-Omni's voice.add): there a message over the
# relay's byte burst costs the whole burst (one per refill) and is passed on, for the worker to judge against its own
# bound (llm_server/doors/vllm_omni.py) and answer in the door's protocol, rather than dropped unanswered here.
LARGE_MESSAGE_SOCKETS = ("/v1/audio/speech/stream",)
SPEECH_POSTS = ("/v1/audio/speech", "/tts/bytes", "/v1/speak", "/v1/text-to-speech/{voice_id}",
                "/v1/text-to-speech/{voice_id}/stream", "/v1/text-to-speech/{voice_id}/stream/with-timestamps",
                "/environments/{environment}/predict")
SOCKETS = ("/tts/websocket", "/v1/speak", "/v1/text-to-speech/{voice_id}/multi-stream-input",
           "/v1/text-to-speech/{voice_id}/stream-input", "/environments/{environment}/websocket",
           "/v1/audio/speech/websocket", "/v1/audio/speech/stream", "/v1/bridges/unmute/tts/{model:path}")
MAX_STREAMS = 4096  # streams relayed at once, by default (FrontConfig.max_streams)
PROBE_EVERY_S = 1.0  # each worker's /ready is probed this often, in the background
PROBE_TIMEOUT_S = 2.0
TIMEOUTS_TO_UNREADY = 3  # probes timed out in a row before a worker counts as not ready


class FrontConfig(TlsSettings):
    """Settings of a front run alone (`megapod-front`, or `megapod front`); flags --field-name, variables
    MEGAPOD_FRONT_FIELD; TLS from the ssl_* fields (orpheus_common/tls.py). It reaches workers over http://."""

    model_config = SettingsConfigDict(env_prefix="MEGAPOD_FRONT_", cli_prog_name="megapod-front")

    host: str = "0.0.0.0"
    port: int = 8000
    workers: str = ""  # worker base URLs, comma-separated: http://10.0.0.5:8000,...
    workers_dns: str = ""  # or host:port of a headless Service: every address it resolves to is a worker
    refresh_s: float = Field(5.0, gt=0)  # how often workers_dns is resolved again (pods come, go, get new addresses)
    grace_s: float = Field(15.0, ge=0)  # SIGTERM: how long streams in flight may finish
    # Streams relayed at once: each holds a connection to its worker for its whole length, so the pool
    # must not be smaller than the MegaPod's stream capacity (httpx's default of 100 made the 101st
    # stream wait for one to end). Past it a new stream waits POOL_WAIT_S, then gets a 503.
    max_streams: int = Field(MAX_STREAMS, ge=1)

    @model_validator(mode="after")
    def _consistent(self) -> FrontConfig:
        if bool(self.workers) == bool(self.workers_dns):
            raise ValueError("give either workers (URLs) or workers_dns (host:port), exactly one")
        if self.workers_dns:
            host, _, port = self.workers_dns.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"workers_dns is host:port, not {self.workers_dns!r}")
        for url in self.worker_urls():
            if not url.startswith("http://"):
                raise ValueError(f"worker URLs are http://host:port, not {url!r}")
        return self

    def worker_urls(self) -> list[str]:
        return [u.strip().rstrip("/") for u in self.workers.split(",") if u.strip()]


class WorkerPool:
    """Active stream counts per worker and the free capacity each last reported; picks the most free,
    then the least active, rotating among ties. The worker set may change (update): a worker that
    leaves gets no new streams, and its streams in flight finish."""

    def __init__(self, urls: Sequence[str], on_forget: Callable[[str], None] = lambda url: None) -> None:
        self.urls = list(urls)
        self.active = {u: 0 for u in self.urls}
        self._reported: dict[str, tuple[int, int]] = {}  # url -> (free it reported, our active streams on it then)
        self._loaded: dict[str, set[str]] = {}  # url -> the LoRA voices it last said its engine holds
        self._turn = itertools.count()
        self._on_forget = on_forget  # a worker left and holds no stream any more

    def order(self, voice: str | None = None) -> list[str]:
        """Workers to try: most free capacity first (a worker not heard from yet first of all: it is
        tried), then one whose engine holds `voice`'s LoRA adapter, then least active (ties rotate so load
        spreads when all are idle)."""
        if not self.urls:
            return []
        start = next(self._turn) % len(self.urls)
        rotated = self.urls[start:] + self.urls[:start]
        voice = voice.lower() if voice else None
        return sorted(rotated, key=lambda u: (-self.free(u), voice not in self._loaded.get(u, ()), self.active[u]))

    def report(self, url: str, free: str | None, uncounted: int = 0, loaded: str | None = None) -> None:
        """`url` said it would admit `free` more streams (its CAPACITY_FREE header) while we held
        active[url] streams on it, `uncounted` of them not yet admitted there (a socket before it
        speaks), and that its engine holds the LoRA voices `loaded` (its LOADED_VOICES header; absent:
        none); the count is ignored when absent or not a count."""
        if url not in self.active:
            return
        self._loaded[url] = voices_of_header(loaded)
        if free is not None and free.isascii() and free.isdecimal():
            self._reported[url] = (int(free), self.active[url] - uncounted)

    def free(self, url: str) -> float:
        """Streams `url` would admit now, as far as we know: what it last reported, less the streams we
        sent it since (plus those that ended since). Unknown: infinite."""
        if url not in self._reported:
            return math.inf
        free, active_then = self._reported[url]
        return free - (self.active[url] - active_then)

    def update(self, urls: Sequence[str]) -> None:
        """The current workers: new ones join at 0 streams; one that left is forgotten once idle."""
        self.urls = list(urls)
        for url in self.urls:
            self.active.setdefault(url, 0)
        for url in list(self.active):
            self._forget_if_gone(url)

    def acquire(self, url: str) -> bool:
        """Hold a slot on `url` from before its request is sent: concurrent requests spread, and a
        refresh meanwhile cannot forget a worker a request is still waiting on. False (no slot) if
        `url` left the pool since order() was taken: a worker that left gets no new stream."""
        if url not in self.urls:
            return False
        self.active[url] += 1
        return True

    def release(self, url: str) -> None:
        self.active[url] -= 1
        self._forget_if_gone(url)

    def _forget_if_gone(self, url: str) -> None:
        if url not in self.urls and self.active[url] == 0:
            del self.active[url]
            self._reported.pop(url, None)
            self._loaded.pop(url, None)
            self._on_forget(url)


class WorkerReadiness:
    """Each worker's readiness as its /ready last said, probed in the background, so the front's own
    /ready answers at once from it. A refused connection or a 503 is believed at once; a probe that
    timed out only TIMEOUTS_TO_UNREADY times in a row. A probe answered on demand with a 1 s timeout
    made the front unready while its worker served 300 streams beside a loaded machine (issue 23); a
    hung worker is still out within seconds, and routing never waits on this (it tries the next worker).
    """

    def __init__(self, client: httpx.AsyncClient, every_s: float = PROBE_EVERY_S, timeout_s: float = PROBE_TIMEOUT_S,
                 timeouts_to_unready: int = TIMEOUTS_TO_UNREADY) -> None:
        self._client = client
        self.every_s, self.timeout_s, self.timeouts_to_unready = every_s, timeout_s, timeouts_to_unready
        self._ready: dict[str, bool] = {}  # url -> its last verdict; a worker never probed is not ready
        self._timeouts: dict[str, int] = {}  # url -> probes timed out in a row

    def any_ready(self, urls: Sequence[str]) -> bool:
        return any(self._ready.get(url, False) for url in urls)

    async def probe(self, urls: Sequence[str]) -> None:
        """Probe every worker in `urls` at once; forget any other."""
        await asyncio.gather(*(self._probe(url) for url in urls))
        for url in (self._ready.keys() | self._timeouts.keys()) - set(urls):  # one that only timed out, too
            self._ready.pop(url, None)
            self._timeouts.pop(url, None)

    async def run(self, pool: WorkerPool) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.probe(pool.urls)
            except Exception:  # a surprise must not freeze every verdict for the pod's life
                log.exception("probing the workers' readiness failed")

    async def _probe(self, url: str) -> None:
        try:
            ready = (await self._client.get(f"{url}/ready", timeout=self.timeout_s)).status_code == 200
        except httpx.TimeoutException:
            self._timeouts[url] = self._timeouts.get(url, 0) + 1
            if self._timeouts[url] >= self.timeouts_to_unready:
                self._ready[url] = False
            return
        except httpx.HTTPError:  # refused, reset: it is not serving
            ready = False
        self._timeouts[url] = 0
        self._ready[url] = ready


Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_all(host: str, port: int) -> list[str]:
    """Every address `host` resolves to: for a headless Service, each ready pod's."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


def _url(address: str, port: int) -> str:
    return f"http://[{address}]:{port}" if ipaddress.ip_address(address).version == 6 else f"http://{address}:{port}"


class DnsWorkers:
    """Keeps a WorkerPool equal to what a name resolves to, again every `refresh_s`.

    Why DNS and not the Endpoints API: the headless Service's records are the ready pods (the
    same rule the API's EndpointSlices follow), resolving needs no service account token, RBAC or
    API server in the data path, and staleness costs nothing but a refused connect: a worker that
    has left closes its listener, and the front tries the next one (see deploy/README.md).
    """

    def __init__(self, pool: WorkerPool, target: str, refresh_s: float, resolve: Resolver = resolve_all) -> None:
        host, _, port = target.rpartition(":")
        self.pool, self.host, self.port, self.refresh_s = pool, host, int(port), refresh_s
        self._resolve = resolve

    async def refresh(self) -> None:
        try:
            addresses = await self._resolve(self.host, self.port)
        except socket.gaierror as exc:
            if exc.errno not in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
                log.warning("cannot resolve %s (%s): keeping %d worker(s)", self.host, exc, len(self.pool.urls))
                return
            addresses = []  # the name has no records: no worker is ready
        urls = [_url(a, self.port) for a in addresses]
        if urls != self.pool.urls:
            log.info("workers behind %s: %s", self.host, ", ".join(urls) or "none")
        self.pool.update(urls)

    async def run(self) -> None:
        """Resolve again every refresh_s (after the first refresh, which the app awaits at start-up)."""
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except Exception:  # an unexpected failure must not freeze the worker list for the pod's life
                log.exception("resolving %s failed: keeping %d worker(s)", self.host, len(self.pool.urls))


def create_front_app(worker_urls: Sequence[str] = (), workers_dns: str = "", refresh_s: float = 5.0,
                     resolve: Resolver = resolve_all, max_streams: int = MAX_STREAMS) -> FastAPI:
    """The front app over the given worker base URLs (http://host:port), or over every address
    `workers_dns` (host:port) resolves to, resolved again every refresh_s while the app runs; up to
    `max_streams` streams relayed at once (its connections to the workers)."""
    registry = CollectorRegistry()
    active = Gauge("megapod_front_active_streams", "Streams relayed, per worker", ["worker"], registry=registry)
    routed = Counter("megapod_front_requests", "Speech requests by worker and status", ["worker", "status"], registry=registry)
    replied = Counter("megapod_front_replies", "Speech requests by the status the client got (a worker's 429 "
                      "retried on the next worker counts once, as what came of it)", ["status"], registry=registry)
    loop_lag = LoopLag(registry)
    pool = WorkerPool(worker_urls, on_forget=_forget_series(active, routed))
    client = httpx.AsyncClient(timeout=TIMEOUT,
                               limits=httpx.Limits(max_connections=max_streams, max_keepalive_connections=KEEPALIVE))
    discovery = DnsWorkers(pool, workers_dns, refresh_s, resolve) if workers_dns else None
    readiness = WorkerReadiness(client)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        watching = None
        if discovery is not None:
            await discovery.refresh()  # workers known before the first request
            watching = asyncio.create_task(discovery.run())
        await readiness.probe(pool.urls)  # /ready is true from the start
        probing = asyncio.create_task(readiness.run(pool))
        lagging = asyncio.create_task(loop_lag.watch())
        # Its modules and app stay for the process's life: out of the collector's sight, as in the servers.
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            probing.cancel()
            lagging.cancel()
            if watching is not None:
                watching.cancel()
            await client.aclose()

    app = FastAPI(title="Orpheus MegaPod front", lifespan=lifespan)
    app.add_middleware(connections.ConnectionMiddleware)  # a worker's cut passed on (_RelayedResponse._cut)
    connections.quiet_deliberate_aborts()
    app.state.pool = pool
    app.state.draining = False  # set on SIGTERM (serve_front): /ready says 503 from then on

    async def speech(request: Request) -> Response:
        reply = await _route(request)
        replied.labels(str(reply.status_code)).inc()
        return reply

    async def _route(request: Request) -> Response:
        body = await _bounded_body(request)
        if body is None:
            return error_response(413, f"request body over {MAX_BODY_BYTES} bytes")
        headers = {"content-type": request.headers.get("content-type", "application/json"), **_passed(request)}
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        at_limit, retry_after = False, None  # a refusal's Retry-After: the first refusing worker's (_whole_seconds)
        timed_out: list[str] = []  # workers whose connect timed out: tried again after the others
        for url, timeout in _attempts(pool.order(requested_voice(request.url.path, body)), timed_out):
            if not pool.acquire(url):
                continue
            try:
                upstream = await client.send(client.build_request("POST", f"{url}{target}", content=body, headers=headers,
                                                                  timeout=timeout), stream=True)
                headers[ADMISSION_WAIT] = "0"  # only the first worker that answers (the most free) may queue it
            except httpx.HTTPError as exc:  # refused (a worker that left or is draining), or no connection in time
                pool.release(url)
                log.warning("worker %s unreachable (connect allowed %.0f s): %r", url, timeout.connect, exc)
                if isinstance(exc, httpx.ConnectTimeout) and timeout is TIMEOUT:  # gone without a word, or only slow
                    timed_out.append(url)
                continue
            except BaseException:  # cancelled (the client left) or anything else: the slot goes back
                pool.release(url)
                raise
            routed.labels(url, str(upstream.status_code)).inc()
            if upstream.status_code == 429:
                at_limit, retry_after = True, retry_after or _whole_seconds(upstream.headers.get("retry-after"))
                pool.release(url)  # before the await: a cancellation there must not keep the slot
                pool.report(url, upstream.headers.get(CAPACITY_FREE),  # after: the refused stream is not held
                            loaded=upstream.headers.get(LOADED_VOICES))
                await _discard(upstream)
                continue
            if upstream.is_success:  # admitted: the worker's count has this stream, as ours does
                pool.report(url, upstream.headers.get(CAPACITY_FREE), loaded=upstream.headers.get(LOADED_VOICES))
            return _relay(upstream, url, pool, active)
        if not at_limit:
            return error_response(503, "no worker reachable", code="not_ready", headers={"Retry-After": "1"})
        return error_response(429, "every worker is at its stream limit; retry shortly", code="rate_limit_exceeded",
                              headers={"Retry-After": retry_after or "1"})

    async def relay_socket(ws: WebSocket) -> None:
        await _relay_socket(ws, pool, active)

    for path in SPEECH_POSTS:
        app.add_api_route(path, speech, methods=["POST"])
    for path in SOCKETS:
        app.add_api_websocket_route(path, relay_socket)

    @app.get("/v1/voices")
    @app.get("/voices")  # Cartesia's List Voices
    async def voices(request: Request) -> Response:
        return await _forward(client, pool, request)

    @app.post("/v1/voices")
    @app.delete("/v1/voices/{name}")
    async def change_voices(request: Request) -> Response:
        """A clone made or deleted: by one worker, into the voices directory every worker reads."""
        body = await _bounded_body(request, VOICE_UPLOAD_BYTES)
        if body is None:
            return error_response(413, f"request body over {VOICE_UPLOAD_BYTES} bytes")
        return await _forward(client, pool, request, body, timeout=VOICE_TIMEOUT_S)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await _forward(client, pool, request)

    app.add_api_route("/", playground, methods=["GET"], include_in_schema=False)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        if app.state.draining:
            return error_response(503, "draining: finishing in-flight streams before exit", code="not_ready")
        if readiness.any_ready(pool.urls):
            return JSONResponse({"status": "ready"})
        return error_response(503, "no worker is ready", code="not_ready")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


_VOICE_IN_PATH = re.compile(r"^/v1/text-to-speech/([^/]+)")  # ElevenLabs' doors name the voice in the path


def requested_voice(path: str, body: bytes = b"") -> str | None:
    """The voice a request asks for, where the front can read it before routing: ElevenLabs' path, a JSON body's
    `voice` (OpenAI's name, Cartesia's {"id"}). None otherwise (a socket's messages, Deepgram's model)."""
    if found := _VOICE_IN_PATH.match(path):
        return unquote(found.group(1))
    if not body.startswith(b"{"):
        return None
    try:
        voice = json.loads(body).get("voice")
    except (ValueError, AttributeError):
        return None  # the worker says what is wrong with it
    voice = voice.get("id") if isinstance(voice, dict) else voice
    return voice if isinstance(voice, str) else None


def _attempts(workers: list[str], timed_out: list[str]) -> Iterator[tuple[str, httpx.Timeout]]:
    """Each worker with the short connect timeout, in order; then each whose connect timed out meanwhile
    (`timed_out`, filled by the caller as it goes) once more with the long one. A front starved of CPU
    beside a loaded machine turned a flood's knocks on a reachable worker into 503s this way (issue 23)."""
    for url in workers:
        yield url, TIMEOUT
    for url in timed_out:
        yield url, SLOW_TIMEOUT


async def _bounded_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes | None:
    """The request body, or None as soon as it grows past `limit` (never read whole)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _passed(request: Request) -> dict[str, str]:
    return {name: request.headers[name] for name in _PASSED_HEADERS if name in request.headers}


async def _forward(client: httpx.AsyncClient, pool: WorkerPool, request: Request, body: bytes = b"",
                   timeout: float = 5.0) -> Response:
    """The request, to the first worker that takes it (the next one if a worker cannot be reached)."""
    headers = _passed(request)
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    if body:
        headers["content-type"] = request.headers.get("content-type", "application/octet-stream")
    for url in pool.order():
        try:
            reply = await client.request(request.method, f"{url}{target}", content=body or None,
                                         headers=headers, timeout=timeout)
        except httpx.HTTPError as exc:
            if isinstance(exc, httpx.ConnectError) or request.method == "GET":
                continue
            # It took the request, then failed or timed out: a voice made or deleted is not asked for twice.
            log.warning("worker %s failed %s %s: %r", url, request.method, request.url.path, exc)
            return error_response(502, f"the worker failed the request: {type(exc).__name__}")
        relayed = {k: v for k, v in reply.headers.items() if k.lower() in ("www-authenticate", "x-request-id", "retry-after")}
        return Response(reply.content, reply.status_code, headers=relayed, media_type=reply.headers.get("content-type"))
    return error_response(503, "no worker reachable")


def _whole_seconds(retry_after: str | None) -> str | None:
    """A worker's Retry-After if it is whole seconds. The front passes on the first refusing worker's: the most free,
    the one whose queue the request waited in. Each worker's is a draw between its queue's wait and when it expects a
    slot (llm_server/doors/http.py, refused_error), and the soonest or the longest of several would undo the spread."""
    seconds = whole_number(retry_after)
    return None if seconds is None else str(seconds)


async def _discard(refusal: httpx.Response) -> None:
    """A refusal's body read to its end, so that its connection goes back to the pool for the next request.
    Closed unread, every 429 cost a new connection to the worker: a flood of knocks left thousands of sockets
    in TIME_WAIT, on the way to running out of local ports. A body that does not come within REFUSAL_READ_S
    (or a cancel) closes the connection instead; the close is shielded (see _RelayedResponse)."""
    try:
        with anyio.move_on_after(REFUSAL_READ_S):
            await refusal.aread()
    finally:
        with anyio.CancelScope(shield=True):
            await refusal.aclose()


class _RelayedResponse(StreamingResponse):
    """A worker's reply streamed on until its end or until the client leaves; however it ends, the
    upstream response closes (the worker sees the cut and aborts its stream) and `done` runs.

    The close is never left to a task that can be cancelled: cancelling a task inside httpx's
    `aclose()` (as a disconnect watcher did, cancelled by the body's own `finally`) skips the pool's
    release of the connection, and after 100 barge-ins (httpx's pool size) every new stream waited out
    its pool timeout into a 503, for good.
    """

    def __init__(self, upstream: httpx.Response, url: str, done: Callable[[], None], headers: dict) -> None:
        super().__init__(upstream.aiter_raw(), status_code=upstream.status_code, headers=headers)
        self._upstream, self._url, self._done = upstream, url, done

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as streaming:  # the body, until the client leaves
                streaming.start_soon(_cancel_on_disconnect, receive, streaming.cancel_scope)
                with contextlib.suppress(OSError):  # a write to a client that left (ASGI 2.4 servers raise)
                    try:
                        await self.stream_response(send)
                    except httpx.HTTPError as exc:
                        self._cut(exc)
                streaming.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._upstream.aclose()  # closes the worker's connection if its reply is not over
            self._done()


    def _cut(self, exc: httpx.HTTPError) -> None:
        """The worker cut its reply mid-body (a stream that failed after its audio went out ends so, on purpose):
        the client's body ends without its last chunk too, and that is the one line said of it."""
        log.warning("worker %s cut its reply mid-body (%s): the client's body ends incomplete too", self._url,
                    type(exc).__name__)
        if (connection := connections.current()) is not None:
            connection.end_response_early()


async def _cancel_on_disconnect(receive: Callable[[], Awaitable[dict]], scope: anyio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


def _relay(upstream: httpx.Response, url: str, pool: WorkerPool, active: Gauge) -> StreamingResponse:
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _NOT_RELAYED}
    headers["x-megapod-worker"] = url
    active.labels(url).inc()  # the pool's slot was taken before the request went out

    def done() -> None:
        active.labels(url).dec()
        pool.release(url)

    return _RelayedResponse(upstream, url, done, headers)


async def _relay_socket(ws: WebSocket, pool: WorkerPool, active: Gauge) -> None:
    """One client socket to the least active worker's, message by message both ways; either side's
    close closes the other (a worker's 1013 reaches the client as 1013)."""
    target = ws.url.path + (f"?{ws.url.query}" if ws.url.query else "")
    headers = {name: ws.headers[name] for name in _PASSED_HEADERS if name in ws.headers}
    for url in pool.order(requested_voice(ws.url.path)):
        if not pool.acquire(url):
            continue
        try:
            upstream = await connect("ws" + url.removeprefix("http") + target, additional_headers=headers)
        except InvalidStatus:  # the worker refused the handshake (a missing or unknown key): so does the front
            pool.release(url)
            await ws.close(1008)
            return
        except OSError as exc:
            pool.release(url)
            log.warning("worker %s unreachable: %s", url, exc)
            continue
        except BaseException:
            pool.release(url)
            raise
        pool.report(url, upstream.response.headers.get(CAPACITY_FREE), uncounted=1,  # it takes a slot once it speaks
                    loaded=upstream.response.headers.get(LOADED_VOICES))
        break
    else:
        await ws.accept()
        await ws.close(TRY_AGAIN_LATER, "no worker reachable")
        return
    active.labels(url).inc()  # the pool's slot was taken before the handshake
    try:
        await ws.accept()  # inside: a client gone here must not keep the slot or the worker's socket
        await _pump_both_ways(ws, upstream)
    finally:
        active.labels(url).dec()
        pool.release(url)
        await upstream.close()


def _forget_series(*metrics: Gauge | Counter) -> Callable[[str], None]:
    """Drop a departed worker's series: pod addresses come and go, and would pile up."""
    def forget(url: str) -> None:
        for metric in metrics:
            (family,) = metric.collect()
            # Label values in the metrics' own order: worker, then status where there is one.
            series = {tuple(s.labels[n] for n in ("worker", "status") if n in s.labels) for s in family.samples}
            for labels in series:
                if labels[0] == url:
                    metric.remove(*labels)
    return forget


async def _pump_both_ways(ws: WebSocket, upstream) -> None:
    budget = SocketBudget(RELAY_LIMITS)
    over_budget = False  # the front's decision to close: 1008 to both sides
    most = RELAY_LIMITS.byte_burst if ws.url.path in LARGE_MESSAGE_SOCKETS else float("inf")  # a message's most cost

    async def client_to_worker() -> None:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            data = message["text"] if message.get("text") is not None else message["bytes"]
            verdict = budget.admit(min(len(data), most))
            if verdict == SocketBudget.CLOSE:
                log.warning("a client socket on %s went on over the relay's budget (%d messages dropped): closed",
                            ws.url.path, budget.refused)
                nonlocal over_budget
                over_budget = True
                return
            if verdict == SocketBudget.OK:
                await upstream.send(data)
                await asyncio.sleep(0)  # a backlog of queued messages must not hold the loop from other streams
            else:
                await asyncio.sleep(budget.refill_s())  # not read meanwhile: the flood waits in its sender's buffers

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
        code = POLICY_VIOLATION if over_budget else upstream.close_code or 1000
        # The client first: the worker's close handshake must not wait on a flood the front is still reading.
        with contextlib.suppress(RuntimeError, WebSocketDisconnect, ConnectionClosed):
            await ws.close(code)
        await upstream.close()


def serve_front(config: FrontConfig) -> None:
    """Run the front alone until SIGTERM: it then stops accepting, says 503 on /ready, and lets
    the streams in flight finish for up to grace_s (orpheus_common/draining.py, as a worker does)."""
    from orpheus_common.draining import DrainingServer, server_config  # imported here, not by `megapod say`

    app = create_front_app(config.worker_urls(), config.workers_dns, config.refresh_s, max_streams=config.max_streams)
    server = DrainingServer(server_config(app, config.host, config.port, config.grace_s, log_level="info", log_config=None,
                                          **config.uvicorn_settings()))
    server.run()
    if not server.started:
        raise SystemExit(3)


def main(argv: Sequence[str] | None = None) -> None:
    """`megapod-front` (the front image's entrypoint) and `megapod front`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    serve_front(FrontConfig.from_cli(argv))

"""One flood of over-cap speech requests, shared by the soak's --overload and the overload test:
bursts of concurrent POST /v1/audio/speech against a full worker (or the front before it)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx


@dataclass
class Knock:
    """One over-cap request: its status (the exception's name when no answer came, its message and
    cause in `error`), the time to its response headers, and a refusal's headers and body (an
    admitted stream's body is not read)."""

    status: int | str
    latency_s: float
    headers: httpx.Headers | None = None
    body: bytes = b""
    error: str = ""


def knock_body(k: int) -> dict:
    return {"model": "tts-1", "input": f"Flood request number {k}.", "voice": "leo", "response_format": "pcm"}


async def knock(client: httpx.AsyncClient, url: str, body: dict) -> Knock:
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/audio/speech", json=body) as reply:
            latency = time.perf_counter() - t0
            # A 200 means a slot freed as a stream ended: closing it here cancels that stream.
            content = await reply.aread() if reply.status_code != 200 else b""
            return Knock(reply.status_code, latency, reply.headers, content)
    except httpx.HTTPError as exc:
        return Knock(type(exc).__name__, time.perf_counter() - t0, error=f"{exc!r} from {exc.__cause__!r}")


async def flood(
    client: httpx.AsyncClient, url: str, burst: int, *, bursts: int | None = None,
    stop: Callable[[], bool] = lambda: False, body: Callable[[int], dict] = knock_body,
) -> list[Knock]:
    """Bursts of `burst` concurrent knocks, one burst after another, until `bursts` have gone or
    `stop()` says so (checked before each burst)."""
    knocks: list[Knock] = []
    sent = 0
    while (bursts is None or sent < bursts) and not stop():
        knocks += await asyncio.gather(*(knock(client, url, body(len(knocks) + i)) for i in range(burst)))
        sent += 1
    return knocks

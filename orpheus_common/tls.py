"""TLS for the stack's HTTP servers (an LLM worker, the front), HTTP and WebSockets alike, with vLLM's names.

`ssl_certfile` and `ssl_keyfile` turn it on; `ssl_ca_certs` also requires every client to present a certificate
that CA signed (mutual TLS, as the codec link's tls_client_ca). The files are re-read when one changes
(cert-manager's renewal, a Secret's update): new connections get the new certificate, open ones keep theirs,
as the codec tier's CertFiles does for gRPC. A half-rotated pair (a new certificate beside the old key) is not
taken: the old one serves until the pair loads, which the next look tries again. No session tickets are sent
(ReloadingContext says why).
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING

from pydantic import model_validator

from .settings import Settings

if TYPE_CHECKING:  # the settings are read where uvicorn is not (`megapod say`)
    import uvicorn

log = logging.getLogger(__name__)

# How often the files' mtimes are looked at: a Secret's update reaches a pod in about a minute (the kubelet's
# sync), so a few seconds more is nothing; the look is a stat of three files, off the loop.
RELOAD_POLL_S = 10.0


class TlsSettings(Settings):
    """The TLS fields of a server's settings: flags --ssl-certfile, --ssl-keyfile, --ssl-ca-certs (vLLM's)."""

    ssl_certfile: str = ""  # PEM: the server's certificate (and its chain); with ssl_keyfile, TLS on
    ssl_keyfile: str = ""  # PEM: its private key
    ssl_ca_certs: str = ""  # PEM: clients must present a certificate one of these CAs signed

    @model_validator(mode="after")
    def _tls_consistent(self) -> TlsSettings:
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ValueError("ssl_certfile and ssl_keyfile go together")
        if self.ssl_ca_certs and not self.ssl_certfile:
            raise ValueError("ssl_ca_certs needs ssl_certfile and ssl_keyfile (client certificates need TLS)")
        return self

    @property
    def tls(self) -> bool:
        return bool(self.ssl_certfile)

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def uvicorn_settings(self, poll_s: float = RELOAD_POLL_S) -> dict[str, object]:
        """uvicorn.Config's TLS arguments: none without TLS; else the files, and a context re-read on change."""
        if not self.tls:
            return {}
        return {"ssl_certfile": self.ssl_certfile, "ssl_keyfile": self.ssl_keyfile,
                "ssl_ca_certs": self.ssl_ca_certs or None,
                "ssl_cert_reqs": ssl.CERT_REQUIRED if self.ssl_ca_certs else ssl.CERT_NONE,
                "ssl_context_factory": ReloadingContext(poll_s)}


class ReloadingContext:
    """uvicorn's ssl_context_factory: its own context, then the same context re-loaded when a file changes.

    uvicorn calls it from Server.serve (Config.load), on the loop that serves; the watch runs on that loop too,
    so the context is only ever touched on the thread that makes connections from it."""

    def __init__(self, poll_s: float) -> None:
        self._poll_s = poll_s
        self._paths: tuple[str, ...] = ()
        self._watch: asyncio.Task | None = None  # held: the loop keeps only a weak reference to a task

    def __call__(self, config: uvicorn.Config, default: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
        self._paths = tuple(str(p) for p in (config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs) if p)
        stamp, context = self._stamp(), default()
        # No TLS 1.3 session tickets: they reach a client after its handshake, as it writes its first request, and
        # Python's sync WebSocket clients (websockets.sync, under ElevenLabs' SDK) read and write one SSL object from
        # two threads, which can lose that request (benchmarks/tls_sync_clients.py). Resumption saves a handshake
        # per new connection; streams hold theirs for minutes.
        context.num_tickets = 0
        try:
            self._watch = asyncio.get_running_loop().create_task(self._watch_files(config, default, context, stamp))
        except RuntimeError:  # loaded outside a loop: served as loaded, not re-read
            log.warning("TLS files of %s are not watched: uvicorn's config was loaded outside the serving loop",
                        config.port)
        return context

    def _stamp(self) -> tuple[int, ...]:
        return tuple(os.stat(p).st_mtime_ns for p in self._paths)

    async def _watch_files(self, config: uvicorn.Config, default: Callable[[], ssl.SSLContext],
                           live: ssl.SSLContext, stamp: tuple[int, ...]) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            try:
                now = await asyncio.to_thread(self._stamp)
                if now == stamp:
                    continue
                default()  # the files as a whole load (a matching pair): else an error, and the old one serves
                live.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
                if config.ssl_ca_certs:
                    live.load_verify_locations(config.ssl_ca_certs)  # adds the new CA; the old one stays trusted
            except (OSError, ssl.SSLError) as exc:
                log.warning("TLS files not reloaded (the old certificate serves): %s", exc)
                continue
            stamp = now
            log.info("TLS certificates reloaded from %s", ", ".join(self._paths))

"""Assemble and run the SNAC tier: model, runner, batcher, gRPC service, health, metrics."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from wsgiref.simple_server import WSGIServer

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from codec_contract.api import codec_pb2_grpc
from codec_contract.audio import STREAMING_DELAY_SAMPLES
from codec_contract.client import SERVICE

from .batcher import MicroBatcher, WarmUpFailed
from .codec_model import SnacEncoder, build_decoder, load_snac
from .config import SnacServerConfig
from .metrics import SnacMetrics
from .runner import DecoderRunner
from .service import CodecService
from .streaming import StreamingDecoder

log = logging.getLogger("snac_server")



@dataclass
class SnacServer:
    """A built, not yet started, codec server and the parts tests may look at."""

    config: SnacServerConfig
    grpc_server: grpc.aio.Server
    batcher: MicroBatcher
    service: CodecService
    health: health.aio.HealthServicer
    metrics: SnacMetrics
    health_server: grpc.aio.Server | None = None  # plaintext grpc.health.v1 only (config.health_port)
    health_port: int | None = None
    metrics_http: WSGIServer | None = None

    @property
    def metrics_port(self) -> int | None:
        return self.metrics_http.server_port if self.metrics_http else None

    async def start(self) -> None:
        """Start serving; report SERVING only after the decoder has warmed up."""
        if self.config.metrics_port >= 0:
            self.metrics_http, _ = start_http_server(
                self.config.metrics_port, self.config.host, registry=self.metrics.registry
            )
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # grpc's default for "" is SERVING
        await self.health.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.health_server is not None:  # open before warm-up: probes read NOT_SERVING, not a refusal
            await self.health_server.start()
        self.batcher.start()
        try:
            await asyncio.to_thread(self.batcher.wait_ready)
        except WarmUpFailed:
            await self._stop_health()
            self._stop_metrics()
            raise
        # The model and the libraries stay for the process's life: out of the collector's sight, a full
        # collection no longer walks them (llm_server/api.py says what that cost the worker).
        gc.collect()
        gc.freeze()
        await self.grpc_server.start()
        for name in ("", SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: report NOT_SERVING, let in-flight streams finish (up to grace), then stop."""
        await self.health.enter_graceful_shutdown()
        await self.grpc_server.stop(self.config.grace_s if grace_s is None else grace_s)
        await self._stop_health()  # answered NOT_SERVING through the drain; closes after it
        await asyncio.to_thread(self.batcher.stop)
        self._stop_metrics()

    async def _stop_health(self) -> None:
        if self.health_server is not None:
            await self.health_server.stop(None)

    def _stop_metrics(self) -> None:
        if self.metrics_http is not None:
            self.metrics_http.shutdown()
            self.metrics_http.server_close()
            self.metrics_http = None


class CertFiles:
    """grpcio's certificate fetcher over the configured TLS files, re-read when one changes.

    grpcio calls it before each new connection's handshake; it answers None (keep the current
    certificates) unless a file's mtime moved, so rotating the files (cert-manager, a Secret
    update) needs no restart: new connections get the new certificates, open ones keep theirs.
    """

    def __init__(self, config: SnacServerConfig) -> None:
        self._paths = [p for p in (config.tls_cert, config.tls_key, config.tls_client_ca) if p]
        self._config = config
        self._stamp: tuple[int, ...] = ()

    def load(self) -> grpc.ServerCertificateConfiguration:
        """The files as they are now (raises if they cannot be read)."""
        stamp = tuple(os.stat(p).st_mtime_ns for p in self._paths)
        c = self._config
        pair = (Path(c.tls_key).read_bytes(), Path(c.tls_cert).read_bytes())
        client_ca = Path(c.tls_client_ca).read_bytes() if c.tls_client_ca else None
        self._stamp = stamp
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=client_ca)

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        try:
            if tuple(os.stat(p).st_mtime_ns for p in self._paths) == self._stamp:
                return None
            fresh = self.load()
        except OSError as exc:  # mid-rotation (a file missing): keep serving the old certificates
            log.warning("TLS files not reloaded: %s", exc)
            return None
        log.info("TLS certificates reloaded from %s", ", ".join(self._paths))
        return fresh


def server_credentials(config: SnacServerConfig) -> grpc.ServerCredentials:
    """TLS from the configured files; with a client CA, clients must present a certificate it signed."""
    files = CertFiles(config)
    return grpc.dynamic_ssl_server_credentials(
        files.load(), files, require_client_authentication=bool(config.tls_client_ca)
    )


def build_runner(config: SnacServerConfig, metrics: SnacMetrics) -> DecoderRunner:
    """Load the model and the streaming decoder over it, and the runner that steps them."""
    torch.set_num_threads(config.cpu_threads)  # process-wide: the decode thread's forwards use this pool
    decoder = build_decoder(config.model, config.resolved_device, config.dtype, config.max_batch)
    metrics.decoder_snr_db.set(decoder.snr_db)
    streaming = StreamingDecoder(decoder, num_slots=config.max_streams)
    if streaming.delay != STREAMING_DELAY_SAMPLES:  # clients time their stall detector by the contract's figure
        raise ValueError(f"{config.model} decodes with a delay of {streaming.delay} samples, the contract says {STREAMING_DELAY_SAMPLES}")
    return DecoderRunner(decoder, streaming, config.max_batch, config.frame_buckets, config.cuda_graphs, config.max_step_frames,
                        config.compiled_step)


def build_server(config: SnacServerConfig, runner: DecoderRunner | None = None) -> tuple[SnacServer, int]:
    """Wire every part around the runner (the model's, unless a benchmark passes its double);
    returns the server and its bound gRPC port."""
    metrics = SnacMetrics()
    runner = runner or build_runner(config, metrics)
    encoder = SnacEncoder(load_snac(config.model), runner.device) if isinstance(runner, DecoderRunner) else None
    batcher = MicroBatcher(runner, config.max_batch, config.max_wait_ms / 1000.0, metrics)
    service = CodecService(config, batcher, metrics, STREAMING_DELAY_SAMPLES, encoder)
    options = [
        ("grpc.max_connection_age_ms", int(config.max_connection_age_s * 1000)),
        ("grpc.max_connection_age_grace_ms", int(config.max_connection_age_grace_s * 1000)),
        ("grpc.keepalive_time_ms", 20_000),
        # Clients ping every 10 s to notice a hung replica; accept down to 5 s so timer jitter
        # never counts as ping abuse (which would get their connection closed).
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share it
    ]
    server = grpc.aio.server(options=options)
    codec_pb2_grpc.add_SnacCodecServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{config.host}:{config.port}"
    if config.tls_cert:
        port = server.add_secure_port(address, server_credentials(config))
    else:
        port = server.add_insecure_port(address)  # loopback and trusted networks: the default
    if port == 0:
        raise OSError(f"could not bind {config.host}:{config.port}")
    built = SnacServer(config, server, batcher, service, health_servicer, metrics)
    if config.health_port >= 0:
        built.health_server, built.health_port = _health_only_server(config, health_servicer)
    return built, port


def _health_only_server(config: SnacServerConfig, servicer: health.aio.HealthServicer) -> tuple[grpc.aio.Server, int]:
    """A plaintext server carrying nothing but grpc.health.v1, sharing the TLS port's servicer (so
    the same statuses): the kubelet's gRPC probes cannot present a client certificate, and this
    port gives them nothing a certificate would guard (any other method is UNIMPLEMENTED)."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"{config.host}:{config.health_port}")
    if port == 0:
        raise OSError(f"could not bind the health port {config.host}:{config.health_port}")
    return server, port


def _tls_mode(config: SnacServerConfig) -> str:
    if not config.tls_cert:
        return " (plaintext)"
    return " (TLS, client certificates required)" if config.tls_client_ca else " (TLS)"


async def serve(config: SnacServerConfig, runner: DecoderRunner | None = None) -> None:
    """Run until SIGTERM or SIGINT, then drain in-flight streams and exit."""
    server, port = build_server(config, runner)
    await server.start()
    log.info(
        "snac-server on %s:%d%s (model %s, device %s, dtype %s, torch threads %d), metrics on :%s, plaintext health on :%s",
        config.host, port, _tls_mode(config), config.model, config.resolved_device, config.dtype, torch.get_num_threads(),
        server.metrics_port, server.health_port,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining %d streams (grace %.0f s)", server.service.active, config.grace_s)
    await server.stop()
    log.info("stopped")


def main(argv: list[str] | None = None) -> None:
    """Console entry point: `snac-server --port ... --model ...`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(SnacServerConfig.from_cli(argv)))
    except WarmUpFailed as exc:  # exit (Kubernetes restarts the pod and shows why), never hang unready
        log.error("cannot serve: %s", exc, exc_info=exc.__cause__)
        sys.exit(1)


if __name__ == "__main__":
    main()

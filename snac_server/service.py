"""The gRPC Decode service: one bidirectional stream per TTS stream.

Per stream, a reader task turns requests into session input and planned rows, while the
handler itself awaits the rows' PCM in order and writes chunks. Bad input aborts only
that stream with INVALID_ARGUMENT, before anything reaches the model.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from .api import codec_pb2, codec_pb2_grpc
from .batcher import MicroBatcher
from .chunking import AdaptiveSchedule, Policy
from .config import SnacServerConfig
from .frames import InvalidFrames
from .metrics import SnacMetrics
from .session import DecodeRow, DecodeSession, SessionSettings

log = logging.getLogger(__name__)

_POLICIES = {
    codec_pb2.POLICY_REFERENCE: Policy.REFERENCE,
    codec_pb2.POLICY_EXACT: Policy.EXACT,
    codec_pb2.POLICY_ADAPTIVE: Policy.ADAPTIVE,
}
# Frames a client may send ahead of decoding before its stream stops being read (flow control).
MAX_BUFFERED_FRAMES = 4096
_EMPTY_FINAL = object()
# After its final chunk, how long a stream waits for the client to half-close.
HALF_CLOSE_WAIT_S = 5.0


def settings_from_header(header: codec_pb2.SessionHeader, config: SnacServerConfig) -> SessionSettings:
    """Apply server defaults to a client header; raises InvalidFrames on bad values."""
    if header.policy == codec_pb2.POLICY_UNSPECIFIED:
        policy = Policy(config.policy)
    elif header.policy in _POLICIES:
        policy = _POLICIES[header.policy]
    else:
        raise InvalidFrames(f"unknown policy {header.policy}")
    chunk = header.chunk_frames or config.chunk_frames
    if chunk > config.chunk_frames:
        raise InvalidFrames(f"chunk_frames {chunk} exceeds this server's limit {config.chunk_frames}")
    if header.sample_format not in codec_pb2.SampleFormat.values():
        raise InvalidFrames(f"unknown sample_format {header.sample_format}")
    return SessionSettings(header.seed, policy, chunk, header.first_frame, header.emit_from_frame)


def encode_pcm(pcm: np.ndarray, sample_format: int) -> bytes:
    """float32 PCM -> bytes in the session's sample format."""
    if sample_format == codec_pb2.SAMPLE_FORMAT_S16LE:
        return np.round(np.clip(pcm, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
    return pcm.astype("<f4").tobytes()


class _Stream:
    """State shared by one stream's reader task and its writer (the handler)."""

    def __init__(self, session: DecodeSession, sample_format: int) -> None:
        self.session = session
        self.sample_format = sample_format
        self.outbox: asyncio.Queue = asyncio.Queue()  # (row, future, planned_at) | exception | _EMPTY_FINAL
        self.progress = asyncio.Event()
        self.final_queued = False


async def _next_request(requests) -> codec_pb2.DecodeRequest | None:
    """The client's next message, or None once it half-closed.

    grpc raises the parse error of bytes that are not a DecodeRequest from the iterator
    itself; that is bad client input like any other (INVALID_ARGUMENT, not UNKNOWN).
    """
    try:
        return await requests.__anext__()
    except StopAsyncIteration:
        return None
    except DecodeError as exc:
        raise InvalidFrames(f"message is not a DecodeRequest: {exc}") from None


class CodecService(codec_pb2_grpc.SnacCodecServicer):
    """Implements megapod.codec.v1.SnacCodec over a shared MicroBatcher."""

    def __init__(self, config: SnacServerConfig, batcher: MicroBatcher, metrics: SnacMetrics) -> None:
        self._config = config
        self._batcher = batcher
        self._metrics = metrics
        self._schedule = AdaptiveSchedule()
        self.active = 0

    async def Decode(
        self, request_iterator: AsyncIterator[codec_pb2.DecodeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[codec_pb2.PcmChunk]:
        if self.active >= self._config.max_streams:
            self._metrics.streams_total.labels("refused").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"server at {self._config.max_streams} streams")
        self.active += 1
        self._metrics.active_streams.inc()
        outcome = "cancelled"
        try:
            async for chunk in self._serve(request_iterator, context):
                yield chunk
            outcome = "ok"
        except asyncio.CancelledError:
            raise
        except Exception:
            outcome = "error"
            raise
        finally:
            self.active -= 1
            self._metrics.active_streams.dec()
            self._metrics.streams_total.labels(outcome).inc()

    async def _serve(self, requests, context: grpc.aio.ServicerContext) -> AsyncIterator[codec_pb2.PcmChunk]:
        requests = requests.__aiter__()
        try:
            stream = await self._open(requests)
        except InvalidFrames as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        reader = asyncio.create_task(self._read(requests, stream))
        try:
            while True:
                item = await stream.outbox.get()
                if isinstance(item, InvalidFrames):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(item))
                if isinstance(item, Exception):
                    await context.abort(grpc.StatusCode.INTERNAL, f"decode failed: {item}")
                if item is _EMPTY_FINAL:
                    yield codec_pb2.PcmChunk(first_frame=stream.session.received, num_frames=0, final=True)
                    await self._check_after_end(reader, stream, context)
                    return
                row, future, planned_at = item
                try:
                    pcm = await future
                except Exception as exc:
                    log.error("decode of stream chunk failed: %s", exc)
                    await context.abort(grpc.StatusCode.INTERNAL, f"decode failed: {exc}")
                yield self._chunk(row, pcm, stream.sample_format)
                self._metrics.chunk_latency.observe(time.perf_counter() - planned_at)
                stream.session.on_delivered(row)
                self._plan(stream)
                if row.final:
                    await self._check_after_end(reader, stream, context)
                    return
        finally:
            reader.cancel()
            self._drop(stream)

    @staticmethod
    async def _check_after_end(reader: asyncio.Task, stream: _Stream, context: grpc.aio.ServicerContext) -> None:
        """After the final chunk, wait for the client's half-close and fail on anything it sent late.

        A client that keeps its side open past HALF_CLOSE_WAIT_S ends with OK all the same.
        """
        try:
            await asyncio.wait_for(asyncio.shield(reader), HALF_CLOSE_WAIT_S)
        except TimeoutError:
            return
        while not stream.outbox.empty():
            item = stream.outbox.get_nowait()
            if isinstance(item, InvalidFrames):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(item))

    async def _open(self, requests) -> _Stream:
        """Read the session header, which must come first."""
        first = await _next_request(requests)
        if first is None:
            raise InvalidFrames("stream closed before its session header")
        if first.WhichOneof("kind") != "header":
            raise InvalidFrames(f"first message must be a session header, got {first.WhichOneof('kind')}")
        settings = settings_from_header(first.header, self._config)
        session = DecodeSession(
            settings, self._config.window_buckets, self._config.max_inflight_chunks, self._schedule
        )
        return _Stream(session, first.header.sample_format)

    async def _read(self, requests, stream: _Stream) -> None:
        """Feed frames and end-of-stream into the session; report bad input to the writer.

        Whatever ends this task early goes to the outbox: the writer waits on nothing else,
        so a reader that died silently would leave the stream open until the client's deadline.
        """
        try:
            while (request := await _next_request(requests)) is not None:
                kind = request.WhichOneof("kind")
                if kind == "frames":
                    stream.session.add_frames([list(f.codes) for f in request.frames.frames])
                elif kind == "end":
                    stream.session.end()
                elif kind == "header":
                    raise InvalidFrames("session header sent twice")
                else:
                    raise InvalidFrames("empty request")
                self._plan(stream)
                await self._wait_for_room(stream)
            if not stream.session.ended:
                raise InvalidFrames("stream closed without end_of_stream")
        except Exception as exc:  # handed to the writer, which ends the stream with its status
            if not isinstance(exc, InvalidFrames):
                log.exception("reading a Decode stream failed")
            stream.outbox.put_nowait(exc)

    async def _wait_for_room(self, stream: _Stream) -> None:
        """Stop reading while too many frames wait for decoding (gRPC flow control pushes back)."""
        session = stream.session
        while session.received - session.planned > MAX_BUFFERED_FRAMES:
            stream.progress.clear()
            await stream.progress.wait()

    def _plan(self, stream: _Stream) -> None:
        """Submit every row the session can decode now, in order; queue the empty final if due."""
        session = stream.session
        now = time.perf_counter()
        for row in session.plan(now):
            stream.final_queued |= row.final
            stream.outbox.put_nowait((row, self._batcher.submit(row), now))
        if session.ended and session.planned >= session.received and not stream.final_queued:
            stream.final_queued = True
            stream.outbox.put_nowait(_EMPTY_FINAL)
        stream.progress.set()

    @staticmethod
    def _chunk(row: DecodeRow, pcm: np.ndarray, sample_format: int) -> codec_pb2.PcmChunk:
        return codec_pb2.PcmChunk(
            first_frame=row.first_frame,
            num_frames=row.keep_end - row.keep_start,
            pcm=encode_pcm(pcm, sample_format),
            final=row.final,
        )

    @staticmethod
    def _drop(stream: _Stream) -> None:
        """Cancel rows still queued or decoding, so the batcher skips a departed stream's work."""
        while not stream.outbox.empty():
            item = stream.outbox.get_nowait()
            if isinstance(item, tuple):
                item[1].cancel()

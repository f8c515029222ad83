"""The gRPC Decode service: one bidirectional stream per TTS stream.

Per stream, a reader task feeds the client's frames into the session while the handler decodes:
it submits the session's next row (the frames that arrived since the last one, at most what the stream's
listener still has to play: _Stream.row_frames), awaits its PCM,
and sends the samples that became final. Bad input aborts only that stream with INVALID_ARGUMENT,
before anything reaches the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Iterator

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from codec_contract.api import codec_pb2, codec_pb2_grpc
from codec_contract.audio import FRAME_SAMPLES, SAMPLE_RATE, pack_frames

from .batcher import MicroBatcher
from .codec_model import SnacEncoder
from .config import SnacServerConfig
from .frames import InvalidFrames
from .metrics import SnacMetrics
from .session import Emission, ReferenceSession, SessionSettings, StreamingSession

log = logging.getLogger(__name__)

_POLICIES = {codec_pb2.POLICY_STREAMING: "streaming", codec_pb2.POLICY_REFERENCE: "reference"}
# Frames a client may send ahead of decoding before its stream stops being read (flow control).
MAX_BUFFERED_FRAMES = 4096
# After its final chunk, how long a stream waits for the client to half-close.
HALF_CLOSE_WAIT_S = 5.0


class StreamsExhausted(Exception):
    """Every stream slot of this replica is taken."""


def settings_from_header(header: codec_pb2.SessionHeader, config: SnacServerConfig) -> SessionSettings:
    """Apply server defaults to a client header; raises InvalidFrames on bad values."""
    if header.policy == codec_pb2.POLICY_UNSPECIFIED:
        policy = config.policy
    elif header.policy in _POLICIES:
        policy = _POLICIES[header.policy]
    else:
        raise InvalidFrames(f"unknown policy {header.policy}")
    if header.sample_format not in codec_pb2.SampleFormat.values():
        raise InvalidFrames(f"unknown sample_format {header.sample_format}")
    if not (math.isfinite(header.listener_pace) and header.listener_pace >= 0):
        raise InvalidFrames(f"listener_pace {header.listener_pace}: a pace is finite and >= 0 (0: real time)")
    if not (math.isfinite(header.listener_ahead_s) and header.listener_ahead_s >= 0):
        raise InvalidFrames(f"listener_ahead_s {header.listener_ahead_s}: seconds of audio, finite and >= 0 (0: no bound)")
    return SessionSettings(header.seed, policy, header.first_frame, header.emit_from_sample, header.listener_pace or 1.0,
                           header.listener_ahead_s)


def encode_pcm(pcm: np.ndarray, sample_format: int) -> bytes:
    """float32 PCM -> bytes in the session's sample format."""
    if sample_format == codec_pb2.SAMPLE_FORMAT_S16LE:
        return np.round(np.clip(pcm, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
    return pcm.astype("<f4").tobytes()


def recording_of(request: codec_pb2.EncodeRequest, max_s: float) -> np.ndarray:
    """An Encode request's samples, checked: 24 kHz, whole float32 samples, some, at most `max_s` seconds of
    them, every one finite and in [-1, 1]; InvalidFrames saying what is wrong otherwise."""
    if request.sample_rate != SAMPLE_RATE:
        raise InvalidFrames(f"sample_rate {request.sample_rate}: Encode takes {SAMPLE_RATE} Hz (resample first)")
    if len(request.pcm) % 4:
        raise InvalidFrames(f"pcm is {len(request.pcm)} bytes, not whole float32 samples")
    pcm = np.frombuffer(request.pcm, dtype="<f4")
    if not pcm.size:
        raise InvalidFrames("pcm holds no samples")
    if pcm.size > max_s * SAMPLE_RATE:
        raise InvalidFrames(f"{pcm.size / SAMPLE_RATE:.1f} s of audio; this replica encodes at most {max_s:g} s")
    if not np.isfinite(pcm).all():
        raise InvalidFrames("pcm holds samples that are not finite (NaN or infinity)")
    if np.abs(pcm).max() > 1.0:
        raise InvalidFrames("pcm holds samples outside [-1, 1]")
    return pcm


# The fewest frames a row is bounded to (0.34 s of audio): with one-frame rows, streams already behind paid a gRPC
# message, a worker chunk and an HTTP chunk per 85 ms of audio, and fell further behind (issue 43, run 29's 3x level:
# chunks a second up by over half, the audio delivered down by a seventh, 21 streams past the buffer mid-level).
ROW_FRAMES_FLOOR = 4


class _Stream:
    """What one stream's reader task and its handler share, and when its listener needs its next audio."""

    def __init__(self, session: StreamingSession | ReferenceSession, sample_format: int) -> None:
        self.session = session
        self.sample_format = sample_format
        self.changed = asyncio.Event()  # new frames, the end, or a reader error
        self.read = asyncio.Event()  # the handler took frames: a reader held by flow control may go on
        self.error: Exception | None = None
        self.failed = asyncio.Event()  # the reader set `error`: a held row waits no longer
        # The listener plays from the first audio at its pace (a stream's gap restarts it): when it runs out of
        # what was sent is the next row's due time; until the first audio, the stream's arrival.
        self.due = time.perf_counter()
        self.needed_at = -math.inf  # when it last got the audio of a row it needed (needs_row)

    def sent(self, samples: int) -> None:
        """`samples` went out now."""
        if samples:
            pace = self.session.settings.listener_pace
            self.due = max(self.due, time.perf_counter()) + samples / SAMPLE_RATE / pace

    def left_s(self) -> float:
        """Audio its listener still has to play of what was sent (0 once it ran out)."""
        return max(0.0, self.due - time.perf_counter()) * self.session.settings.listener_pace

    def hold_s(self) -> float:
        """How long the next row may wait while other streams need theirs (OpenStreams.busy_s): until the listener is
        within `listener_ahead_s` of running out (0: now, and always before the first audio or with no bound)."""
        settings = self.session.settings
        if not settings.listener_ahead_s or not self.session.started:
            return 0.0
        return (self.left_s() - settings.listener_ahead_s) / settings.listener_pace

    def needs_row(self) -> bool:
        """Whether its listener needs the next row now: before the first audio, or within its bound of running out
        (with no bound, only before the first audio: the rest may run ahead); never once all is decoded."""
        if self.session.drained:
            return False
        if not self.session.started:
            return True
        return bool(self.session.settings.listener_ahead_s) and self.hold_s() <= 0

    def row_frames(self) -> int:
        """The most frames its next row may carry (0: no bound): whole frames of audio its listener still has to
        play, ROW_FRAMES_FLOOR at least. A row of more holds up every row due before the listener runs out: on a CPU
        (a forward of 16 frames), 29 streams started together, 1-3 s left to play at 0.1x when their rows were made,
        got those 16-frame rows one at a time from 9.4 to 20.0 s into issue 43's 3x level (benchmark run 28). A stream
        far ahead still takes whole buckets. No bound before the first audio: run 32 bounded it too, and 7 of the 3x
        level's first streams ran past the buffer, against none in runs 30-31 without (their first chunks were alike:
        the noise between runs, perhaps, but not shown to be)."""
        if not self.session.started:
            return 0
        return max(ROW_FRAMES_FLOOR, int(self.left_s() * SAMPLE_RATE) // FRAME_SAMPLES)


class OpenStreams:
    """A replica's streams being decoded, and whether any needs its next row (_Stream.needs_row). A stream further
    ahead of its listener than its bound waits while another needs its row or did within the stream's bound in time
    (bound over pace: 4.9 s at 0.103x, 0.49 s at 1.03x), and decodes ahead once none has for that long. On shared
    cores (or a shared GPU) a replica that decoded every stream as far ahead as its frames went ended the streams it
    favoured sooner, and round robin piled the others on it (27 streams against 16, issue 43's run 46). Held only while
    another needed its row at that moment, each lull let every held stream decode a row far ahead: at 3x 19-24 % of
    the streams ran fast and 35-37 past the buffer (runs 50-51; held always, 5 % and none, run 47). With the bound's
    time, held streams reach their bounds and need rows themselves: two streams or more on a replica are paced at
    their listeners, as held always (run 52: 5-6 % fast, none past the buffer at 3x). Alone, or once the others are
    quiet, a stream decodes as fast as it can: a body read whole (a client that does not stream) ends as soon as it
    is decoded, not at its listener's pace."""

    def __init__(self) -> None:
        self._streams: set[_Stream] = set()

    @contextlib.contextmanager
    def decoding(self, stream: _Stream) -> Iterator[None]:
        self._streams.add(stream)
        try:
            yield
        finally:
            self._streams.discard(stream)

    def busy_s(self, stream: _Stream) -> float:
        """How long `stream` yields yet (0: not at all): its bound's time at its pace if another stream needs its next
        row now, else what is left of that time since another last did."""
        settings = stream.session.settings
        quiet_s = settings.listener_ahead_s / settings.listener_pace
        now = time.perf_counter()
        busy_s = 0.0
        for other in self._streams:
            if other is not stream:
                if other.needs_row():
                    return quiet_s
                busy_s = max(busy_s, other.needed_at + quiet_s - now)
        return busy_s


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
    """Implements megapod.codec.v3.SnacCodec over a shared MicroBatcher."""

    def __init__(self, config: SnacServerConfig, batcher: MicroBatcher, metrics: SnacMetrics, delay: int,
                 encoder: SnacEncoder | None = None) -> None:
        self._config = config
        self._batcher = batcher
        self._encoder = encoder  # None: this replica does not encode (a benchmark's runner double)
        self._metrics = metrics
        self._delay = delay
        self.active = 0
        self.streams = OpenStreams()

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

    async def Encode(self, request: codec_pb2.EncodeRequest, context: grpc.aio.ServicerContext) -> codec_pb2.EncodeReply:
        if self._encoder is None:
            self._metrics.encodes_total.labels("refused").inc()
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this replica does not encode")
        try:
            pcm = recording_of(request, self._config.max_encode_s)
        except InvalidFrames as exc:
            self._metrics.encodes_total.labels("invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        started = time.perf_counter()
        try:
            frames = await self._encoder.encode_async(pcm)
        except Exception as exc:
            self._metrics.encodes_total.labels("error").inc()
            await context.abort(grpc.StatusCode.INTERNAL, f"encoding failed: {exc}")
        self._metrics.encode_latency.observe(time.perf_counter() - started)
        self._metrics.encodes_total.labels("ok").inc()
        return codec_pb2.EncodeReply(codes=pack_frames(frames))

    async def _serve(self, requests, context: grpc.aio.ServicerContext) -> AsyncIterator[codec_pb2.PcmChunk]:
        requests = requests.__aiter__()
        try:
            stream = await self._open(requests)
        except InvalidFrames as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except StreamsExhausted as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        reader = asyncio.create_task(self._read(requests, stream))
        try:
            async for emission in self._decode(stream, context):
                yield codec_pb2.PcmChunk(first_sample=emission.first_sample, final=emission.final,
                                         pcm=encode_pcm(emission.pcm, stream.sample_format))
                self._metrics.frames_emitted.inc(len(emission.pcm) / FRAME_SAMPLES)
                if emission.final:
                    await self._check_after_end(reader, stream, context)
                    return
        finally:
            reader.cancel()
            if isinstance(stream.session, StreamingSession):
                self._batcher.release_slot(stream.session.slot)

    async def _decode(self, stream: _Stream, context: grpc.aio.ServicerContext) -> AsyncIterator[Emission]:
        """Decode row after row as frames arrive; yield what each makes final, the final emission last."""
        session = stream.session
        with self.streams.decoding(stream):
            while True:
                if stream.error is not None:
                    invalid = isinstance(stream.error, InvalidFrames)
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT if invalid else grpc.StatusCode.INTERNAL,
                                        str(stream.error))
                if (hold := stream.hold_s()) > 0 and (busy := self.streams.busy_s(stream)) > 0:
                    self._metrics.held_streams.inc()
                    try:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(stream.failed.wait(), min(hold, busy))
                    finally:
                        self._metrics.held_streams.dec()
                    continue
                row = session.next_row(stream.row_frames())
                if row is None:
                    if session.drained:  # nothing more to decode: close with an empty final chunk
                        yield Emission(session.emitted, np.zeros(0, np.float32), final=True)
                        return
                    stream.changed.clear()
                    await stream.changed.wait()
                    continue
                stream.read.set()
                needed = stream.needs_row()  # while it decodes, needs_row says so to the others; after, needed_at
                submitted = time.perf_counter()
                try:
                    pcm = await self._batcher.submit(row, stream.due)
                except Exception as exc:
                    log.error("decode of a stream's row failed: %s", exc)
                    await context.abort(grpc.StatusCode.INTERNAL, f"decode failed: {exc}")
                self._metrics.chunk_latency.observe(time.perf_counter() - submitted)
                emission = session.take(row, pcm)
                if emission is not None:
                    stream.sent(len(emission.pcm))
                    if needed:
                        stream.needed_at = time.perf_counter()
                    yield emission

    @staticmethod
    async def _check_after_end(reader: asyncio.Task, stream: _Stream, context: grpc.aio.ServicerContext) -> None:
        """After the final chunk, wait for the client's half-close and fail on anything it sent late.

        A client that keeps its side open past HALF_CLOSE_WAIT_S ends with OK all the same.
        """
        try:
            await asyncio.wait_for(asyncio.shield(reader), HALF_CLOSE_WAIT_S)
        except TimeoutError:
            return
        if isinstance(stream.error, InvalidFrames):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(stream.error))

    async def _open(self, requests) -> _Stream:
        """Read the session header, which must come first; a streaming session takes a state slot."""
        first = await _next_request(requests)
        if first is None:
            raise InvalidFrames("stream closed before its session header")
        if first.WhichOneof("kind") != "header":
            raise InvalidFrames(f"first message must be a session header, got {first.WhichOneof('kind')}")
        settings = settings_from_header(first.header, self._config)
        if settings.policy == "reference":
            return _Stream(ReferenceSession(settings), first.header.sample_format)
        slot = self._batcher.slots.acquire()
        if slot is None:
            raise StreamsExhausted(f"all {self._batcher.slots.size} decoder state slots are taken")
        try:
            session = StreamingSession(settings, slot, self._config.frame_buckets, self._delay)
        except InvalidFrames:
            self._batcher.release_slot(slot)
            raise
        return _Stream(session, first.header.sample_format)

    async def _read(self, requests, stream: _Stream) -> None:
        """Feed frames and end-of-stream into the session; report bad input to the handler.

        Whatever ends this task early is handed over: the handler waits on nothing else, so a reader
        that died silently would leave the stream open until the client's deadline.
        """
        try:
            while (request := await _next_request(requests)) is not None:
                kind = request.WhichOneof("kind")
                if kind == "frames":
                    stream.session.add_frames(request.frames.codes)
                elif kind == "end":
                    stream.session.end()
                elif kind == "header":
                    raise InvalidFrames("session header sent twice")
                else:
                    raise InvalidFrames("empty request")
                stream.changed.set()
                await self._wait_for_room(stream)
            if not stream.session.ended:
                raise InvalidFrames("stream closed without end_of_stream")
        except Exception as exc:  # handed to the handler, which ends the stream with its status
            if not isinstance(exc, InvalidFrames):
                log.exception("reading a Decode stream failed")
            stream.error = exc
            stream.failed.set()
            stream.changed.set()

    @staticmethod
    async def _wait_for_room(stream: _Stream) -> None:
        """Stop reading while too many frames wait for decoding (gRPC flow control pushes back)."""
        while stream.session.backlog > MAX_BUFFERED_FRAMES:
            stream.read.clear()
            await stream.read.wait()

"""The LLM tier's client of the SNAC codec tier: one Decode stream per TTS stream, with failover.

Balancing is gRPC's own: one channel over every replica (an `ipv4:` address list or a
`dns:///` name resolving to several) with the round_robin policy and client-side health
checking, so a draining replica (NOT_SERVING) gets no new streams. Failover is ours: a
stream keeps the frames whose audio has not arrived yet (plus 3 frames of context), and if
its replica dies it reopens on another and resumes exactly where the audio stopped; the
codec's noise depends only on (seed, position), so the audio is the same as undisturbed.

A replica that hangs (stopped, wedged) rather than dies is caught twice: a stream owed audio
that gets none for `stall_timeout_s` fails over as if the replica had died, and keepalive
pings take a silent replica's connection down, so new streams stop being sent to it. One that
falls behind is only measured: each chunk of owed audio adds its length (and a frame's) and the wait
for it to the client's sums, whose ratio over many chunks is the pace the codec tier delivers at while
it owes audio (exported as two counters, runtime.py); admission reads the failovers, and each stream's
listener rather than this pace (capacity.Listeners). A chunk slower than `target_pace` on its own is
counted late (a metric), but a few of those in a burst say little.

TLS (`tls_ca`, optional client certificate) is read when the channel is built; when the files
change, the next stream gets a new channel and the old one closes once its streams are done.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import numpy as np

from codec_contract.api import codec_pb2, codec_pb2_grpc
from codec_contract.audio import (
    CODES_PER_FRAME,
    FRAME_SAMPLES,
    RESUME_CONTEXT_FRAMES,
    SAMPLE_RATE,
    final_samples,
    unpack_frames,
)
from codec_contract.client import END_REQUEST, SERVICE, channel, frames_request

from .playback import Playback

log = logging.getLogger(__name__)

# Status codes after which the same frames are worth resending to another replica.
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
              grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
_SAMPLE_BYTES = {codec_pb2.SAMPLE_FORMAT_S16LE: 2, codec_pb2.SAMPLE_FORMAT_F32LE: 4, codec_pb2.SAMPLE_FORMAT_UNSPECIFIED: 4}
# A channel replaced after a TLS file changed stays open this long for the streams still on it.
_RETIRE_GRACE_S = 300.0


class CodecError(RuntimeError):
    """The codec tier could not produce a stream's audio or a recording's frames (no replica left, or it
    refused the input: `status` then says how)."""

    def __init__(self, message: str, status: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.status = status


def channel_target(addresses: str) -> str:
    """`host:port[,host:port...]` -> an `ipv4:`/`ipv6:` list target; `dns:///...` passes through."""
    if "://" in addresses or addresses.startswith(("dns:", "ipv4:", "ipv6:", "unix:")):
        return addresses
    parts = [a.strip() for a in addresses.split(",") if a.strip()]
    if len(parts) == 1 and not parts[0].split(":")[0].replace(".", "").isdigit():
        return f"dns:///{parts[0]}"  # a name: resolve it, every address becomes a subchannel
    return "ipv4:" + ",".join(p.replace("localhost", "127.0.0.1") for p in parts)


@dataclass(frozen=True)
class CodecClientConfig:
    """How the LLM tier reaches the codec tier."""

    addresses: str = "127.0.0.1:50051"
    policy: int = codec_pb2.POLICY_STREAMING
    sample_format: int = codec_pb2.SAMPLE_FORMAT_S16LE
    # Failed calls in a row (no audio in between) before a stream gives up. A hung replica stays
    # READY until keepalive notices (keepalive_s + keepalive_timeout_s), so a stream may stall
    # on it, re-pick it and stall again before round robin drops it: 6 leaves room for that.
    max_attempts: int = 6
    stall_timeout_s: float = 10.0  # owed audio, none for this long: the replica is hung
    target_pace: float = 1.0  # audio per second of waiting a stream needs from its replica (the worker's target)
    # The most audio a replica decodes a stream ahead of its listener at target_pace while another of its streams
    # needs its next row (0: no bound; the header's listener_ahead_s): replicas sharing cores or a GPU spend nothing on
    # streams far ahead while others fall behind.
    listener_ahead_s: float = 0.0
    keepalive_s: float = 10.0  # ping each connection this often (server accepts >= 5 s)...
    keepalive_timeout_s: float = 5.0  # ...and drop it when a ping goes unanswered this long
    tls_ca: str = ""  # CA file: TLS on (plaintext without it)
    tls_cert: str = ""  # client certificate and key, for replicas that require one
    tls_key: str = ""
    tls_server_name: str = ""  # the name in the replicas' certificates, if not the address


class CodecClient:
    """Opens codec streams over one load-balanced channel; close() when done."""

    def __init__(self, config: CodecClientConfig) -> None:
        self.config = config
        self._tls_stamp: tuple[int, ...] = ()  # before the first read: a missing file then names itself
        self._tls_stamp = self._read_tls_stamp()
        self._channel = self._connect()
        self._stub = codec_pb2_grpc.SnacCodecStub(self._channel)
        self._retired: set[grpc.aio.Channel] = set()  # old channels letting their streams finish
        # Of every stream so far: the codec tier's trouble and pace (metrics; admission reads the failovers).
        self.failovers = 0
        self.deliveries = 0  # chunks of owed audio received
        self.late = 0  # of them, those that came slower than the target pace
        self.owed_audio_s = 0.0  # their audio, a frame's more each (what the target pace allows them)
        self._waited_s = 0.0  # waits that ended: in a chunk, a failover (a stall's silence counts too) or a cancel
        self._live: weakref.WeakSet[CodecStream] = weakref.WeakSet()  # every stream not yet collected: their running waits

    def stream(self, seed: int, stream_id: str = "") -> CodecStream:
        """A new stream; frames go in with send(), audio comes out of chunks()."""
        stream = CodecStream(self.current_stub, self.config, seed, stream_id, on_failover=self._failed_over,
                             on_delivery=self._delivered, on_wait_lost=self._wait_lost)
        self._live.add(stream)
        return stream

    @property
    def owed_wait_s(self) -> float:
        """Seconds streams have waited for owed audio, those still waiting counted up to now: over owed_audio_s,
        the pace the codec delivers at while it owes audio, a stalled replica's silence included as it happens."""
        now = asyncio.get_running_loop().time()
        return self._waited_s + sum(stream.waiting_s(now) for stream in self._live)

    async def encode(self, pcm: np.ndarray, timeout_s: float = 120.0) -> np.ndarray:
        """A recording (24 kHz mono float32 in [-1, 1]) as (n, 7) frames, encoded by a replica round robin picks;
        tried once more (round robin: another replica) if that one is unreachable or fails. CodecError carries
        the replica's status and reason otherwise (INVALID_ARGUMENT: the recording's fault)."""
        request = codec_pb2.EncodeRequest(sample_rate=SAMPLE_RATE, pcm=np.asarray(pcm, "<f4").tobytes())
        for attempt in (1, 2):
            try:
                reply = await self.current_stub().Encode(request, timeout=timeout_s, wait_for_ready=True)
                return unpack_frames(reply.codes)
            except grpc.aio.AioRpcError as exc:
                if attempt == 2 or exc.code() not in _RETRYABLE:
                    raise CodecError(f"{exc.code().name}: {exc.details()}", exc.code()) from exc
        raise AssertionError("unreachable")

    def _failed_over(self) -> None:
        self.failovers += 1

    def _delivered(self, audio_s: float, waited_s: float) -> None:
        """A chunk of owed audio: `audio_s` of it (a frame's allowance included) after `waited_s`."""
        self.deliveries += 1
        self.late += waited_s * self.config.target_pace > audio_s
        self.owed_audio_s += audio_s
        self._waited_s += waited_s

    def _wait_lost(self, waited_s: float) -> None:
        """A wait for owed audio ended without it (the replica stalled, failed or went away)."""
        self._waited_s += waited_s

    def current_stub(self) -> codec_pb2_grpc.SnacCodecStub:
        """The stub every new call uses; a changed TLS file first swaps in a new channel."""
        stamp = self._read_tls_stamp()
        if stamp != self._tls_stamp:
            self._rotate(stamp)
        return self._stub

    async def ready(self, timeout_s: float = 1.0) -> bool:
        """True when at least one replica accepts connections and reports SERVING."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            reply = await health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE), timeout=timeout_s, wait_for_ready=True
            )
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        # A plain close() of a channel still in its graceful close cancels its calls and closes it.
        await asyncio.gather(*(ch.close() for ch in self._retired), self._channel.close())

    def _connect(self) -> grpc.aio.Channel:
        """One channel over every replica: round robin, health checked, keepalive pinged."""
        c = self.config
        service_config = {
            "loadBalancingConfig": [{"round_robin": {}}],
            "healthCheckConfig": {"serviceName": SERVICE},
        }
        options = [
            ("grpc.service_config", json.dumps(service_config)),
            ("grpc.enable_retries", 0),
            ("grpc.keepalive_time_ms", int(c.keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(c.keepalive_timeout_s * 1000)),
            # A keepalive ping that joins one already in flight (flow-control probes) is timed by
            # this instead, 60 s by default: measured, a hung replica then stayed READY a minute.
            ("grpc.http2.ping_timeout_ms", int(c.keepalive_timeout_s * 1000)),
            # Keep pinging while a stream sends nothing: an idle stream's replica may hang too.
            ("grpc.http2.max_pings_without_data", 0),
        ]
        return channel(channel_target(c.addresses), c.tls_ca, c.tls_cert, c.tls_key, c.tls_server_name, options)

    def _read_tls_stamp(self) -> tuple[int, ...]:
        paths = (self.config.tls_ca, self.config.tls_cert, self.config.tls_key)
        try:
            return tuple(os.stat(p).st_mtime_ns for p in paths if p)
        except OSError:
            return self._tls_stamp  # a file missing mid-rotation: keep the channel we have

    def _rotate(self, stamp: tuple[int, ...]) -> None:
        """New connections use the new files; streams on the old channel finish (or fail over)."""
        try:
            channel = self._connect()
        except OSError as exc:
            log.warning("codec TLS files not reloaded: %s", exc)
            return
        old, self._channel, self._tls_stamp = self._channel, channel, stamp
        self._stub = codec_pb2_grpc.SnacCodecStub(channel)
        self._retired.add(old)
        task = asyncio.get_running_loop().create_task(old.close(grace=_RETIRE_GRACE_S))
        task.add_done_callback(lambda _: self._retired.discard(old))
        log.info("codec TLS files changed: new channel")


@dataclass(frozen=True)
class AudioChunk:
    """PCM for samples [first_sample, first_sample + num_samples) of a stream."""

    first_sample: int
    num_samples: int
    pcm: bytes
    final: bool


class CodecStream:
    """One TTS stream's audio: resumable across replica failures, every frame exactly once."""

    def __init__(
        self, stub: Callable[[], codec_pb2_grpc.SnacCodecStub], config: CodecClientConfig, seed: int, stream_id: str,
        on_failover: Callable[[], None] = lambda: None,
        on_delivery: Callable[[float, float], None] = lambda audio_s, waited_s: None,
        on_wait_lost: Callable[[float], None] = lambda waited_s: None,
    ) -> None:
        self._stub = stub  # called per call, so a failover uses the client's newest channel
        self._config = config
        self._seed = seed
        self._stream_id = stream_id
        self._frames = np.zeros((0, CODES_PER_FRAME), dtype=np.int64)
        self._frames_start = 0  # absolute index of self._frames[0]
        self._delivered = 0  # next sample still owed
        self._ended = False
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reading: asyncio.Future | None = None  # the pending call.read(), kept across stall checks
        self._header_write: asyncio.Future | None = None  # a call's first write, while it waits
        self._lock = asyncio.Lock()  # one writer at a time: resends must not interleave new frames
        self._cancelled = False
        self._arrived = asyncio.Event()  # frames or the end came in (or the stream was cancelled)
        self._sample_bytes = _SAMPLE_BYTES[config.sample_format]
        self._stall_clock = 0.0  # when the current wait for audio began
        self._listener = Playback(config.target_pace)  # the stream's listener, as the replica's hold counts it (loop time)
        self.failovers = 0
        self._on_failover = on_failover
        self._on_delivery = on_delivery
        self._on_wait_lost = on_wait_lost

    async def send(self, frames: np.ndarray) -> None:
        """Queue frames (n, 7) for decoding; a dead replica is noticed and replaced by chunks().

        Until chunks() is first read the frames are only kept: the call opens when someone wants
        the audio. A speech stream generates its next sentence while the current one plays; decoding
        that early would take the codec from streams that need audio now, and hold a decoder slot.
        """
        async with self._lock:
            was_owed = self._owed()
            self._frames = np.concatenate([self._frames, frames.astype(np.int64)])
            self._start_stall_clock(was_owed)
            self._arrived.set()
            if self._call is not None:
                await self._write(frames_request(frames))

    async def end(self) -> None:
        """No more frames: the codec flushes the tail."""
        async with self._lock:
            was_owed = self._owed()
            self._ended = True
            self._start_stall_clock(was_owed)
            self._arrived.set()
            if self._call is not None:
                await self._write(END_REQUEST)
                await self._done_writing()

    async def chunks(self) -> AsyncIterator[AudioChunk]:
        """Audio in stream order, through failovers, until the final chunk."""
        attempts = 1
        while True:
            if self._cancelled:
                raise CodecError("stream cancelled")
            if self._call is None:
                await self._arrived.wait()  # nothing sent yet: open once there is something to decode
                async with self._lock:
                    if self._call is None:
                        await self._open()
                continue
            call = self._call
            message = await self._next_message(call)
            if message is grpc.aio.EOF:
                message = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "stream ended before its final chunk")
            if isinstance(message, grpc.aio.AioRpcError):
                attempts = await self._failover(call, message, attempts)
                continue
            if self._owed():
                self._count_delivery(message)
            chunk = self._accept(message)
            attempts = 1  # audio arrived: only failures in a row use up the attempts
            if chunk is not None:
                now = asyncio.get_running_loop().time()
                self._listener.sent(now, chunk.num_samples / SAMPLE_RATE, now)
                yield chunk
                if chunk.final:
                    return

    def _end_wait(self) -> None:
        """The running wait ends without audio (a stall, a failure, a cancel): counted as waited, once (the clock
        restarts, so what the client sums stays monotone: a wait never vanishes from it)."""
        try:
            now = asyncio.get_running_loop().time()
        except RuntimeError:  # no loop (cancelled from outside one): no read can be running
            return
        waited = self.waiting_s(now)
        if waited > 0:
            self._on_wait_lost(waited)
            self._stall_clock = now

    def waiting_s(self, now: float) -> float:
        """How long the read now pending has waited for owed audio (0 while none is pending or none is owed)."""
        if self._reading is None or self._cancelled or not self._owed():
            return 0.0
        return max(0.0, now - self._owed_since())

    def cancel(self) -> None:
        """Abandon the stream (client went away): the codec drops its session."""
        self._end_wait()
        self._cancelled = True
        self._arrived.set()
        if self._call is not None:
            self._call.cancel()
        if self._header_write is not None:
            self._header_write.cancel()

    def _accept(self, message: codec_pb2.PcmChunk) -> AudioChunk | None:
        """Advance past a chunk; drop audio already delivered by a previous replica."""
        if message.first_sample != self._delivered:
            raise CodecError(f"codec sent sample {message.first_sample}, expected {self._delivered}")
        samples = len(message.pcm) // self._sample_bytes
        self._delivered += samples
        self._trim()
        return AudioChunk(message.first_sample, samples, message.pcm, message.final)

    async def _next_message(self, call: grpc.aio.StreamStreamCall) -> object:
        """The call's next message, EOF or error; DEADLINE_EXCEEDED if a replica owing audio goes quiet.

        The read is waited on, not wrapped in a timeout: cancelling it would cancel the call, and a
        stream that is merely idle (the LLM has sent too little for a chunk) must keep its call.
        """
        loop = asyncio.get_running_loop()
        if self._reading is None:
            self._reading = asyncio.ensure_future(call.read())
            # The wait starts now, not at the last chunk: our reader may have been held up (a
            # slow HTTP client), and a replica only owes what it is being asked for.
            self._stall_clock = loop.time()
        reading = self._reading
        while not reading.done():
            # Not owed: look again after a timeout's worth, since a send() may have started the clock.
            left = self._owed_since() + self._config.stall_timeout_s - loop.time() if self._owed() else None
            if left is not None and left <= 0:
                self._end_wait()
                reading.cancel()  # cancels the call too
                self._reading = None
                return grpc.aio.AioRpcError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, None, None,
                    f"no audio for {self._config.stall_timeout_s:.1f} s while owed samples from {self._delivered}",
                )
            try:
                await asyncio.wait({reading}, timeout=self._config.stall_timeout_s if left is None else left)
            except asyncio.CancelledError:
                self._end_wait()
                reading.cancel()  # our reader went away: so does the call, as with a plain read()
                self._reading = None
                raise
        if reading.cancelled():
            message = grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, None, None, "read cancelled")
        else:
            try:
                message = reading.result()
            except grpc.aio.AioRpcError as exc:
                message = exc
        if not isinstance(message, codec_pb2.PcmChunk):
            self._end_wait()  # no audio ended this wait
        self._reading = None
        return message

    def _count_delivery(self, message: codec_pb2.PcmChunk) -> None:
        """A chunk of owed audio arrived: its length and a frame's (the most a replica may hold back before it
        can emit), and the wait for it (since it became owed, or since this read began: a reader held up by a
        slow client does not count against the replica)."""
        waited = max(0.0, asyncio.get_running_loop().time() - self._owed_since())
        samples = len(message.pcm) // self._sample_bytes + FRAME_SAMPLES
        self._on_delivery(samples / SAMPLE_RATE, waited)

    def _owed(self) -> bool:
        """Whether the replica should be producing audio: the frames sent make samples final that
        have not arrived (the contract says how many, per policy)."""
        sent = self._frames_start + len(self._frames)
        return final_samples(self._config.policy, sent, self._ended) > self._delivered

    def _owed_since(self) -> float:
        """When the replica began to owe the audio waited for: the stall clock, or, while the listener still has more
        than listener_ahead_s to play, the moment it gets within it (a replica where others need rows holds the
        row until then; one that sends it sooner was never waited for)."""
        runs_out = self._listener.runs_out_at
        if runs_out is None or not self._config.listener_ahead_s:
            return self._stall_clock
        return max(self._stall_clock, runs_out - self._config.listener_ahead_s / self._config.target_pace)

    def _start_stall_clock(self, was_owed: bool) -> None:
        """The wait for audio starts when the stream becomes owed, not while it was idle."""
        if not was_owed and self._owed():
            self._stall_clock = asyncio.get_running_loop().time()

    async def _failover(self, call: grpc.aio.StreamStreamCall, error: grpc.aio.AioRpcError, attempts: int) -> int:
        if self._cancelled:
            raise CodecError("stream cancelled")
        if error.code() not in _RETRYABLE or attempts >= self._config.max_attempts:
            raise CodecError(f"codec stream failed ({error.code().name}): {error.details()}") from error
        log.warning("codec replica lost (%s) at sample %d; resuming elsewhere", error.code().name, self._delivered)
        async with self._lock:
            if self._call is call:  # not already replaced by a concurrent writer
                call.cancel()
                await self._open()  # not if cancel() came while we waited: chunks() then ends
        self.failovers += 1
        self._on_failover()
        return attempts + 1

    async def _open(self) -> None:
        """Open a call and replay: header, the owed frames with their context, end if seen (not once cancelled)."""
        if self._cancelled:
            return
        first = self._resume_from()
        header = codec_pb2.SessionHeader(
            seed=self._seed, policy=self._config.policy, sample_format=self._config.sample_format,
            first_frame=first, emit_from_sample=self._delivered, stream_id=self._stream_id,
            listener_pace=self._config.target_pace,  # the replica decodes first what is due first at this pace
            listener_ahead_s=self._config.listener_ahead_s,
        )
        self._call = self._stub().Decode(wait_for_ready=True)
        await self._write_header(codec_pb2.DecodeRequest(header=header))
        pending = self._frames[first - self._frames_start :]
        if len(pending):
            await self._write(frames_request(pending))
        if self._ended:
            await self._write(END_REQUEST)
            await self._done_writing()

    async def _write_header(self, request: codec_pb2.DecodeRequest) -> None:
        """A call's first write waits until its headers are out (wait_for_ready: until a replica takes
        the call). grpc.aio (1.85) never wakes a write waiting there once the call is cancelled, which
        would hold the stream, and the lock, for good; so cancel() ends this wait itself."""
        write = self._header_write = asyncio.ensure_future(self._write(request))
        try:
            await asyncio.wait({write})
        except asyncio.CancelledError:
            write.cancel()
            raise
        finally:
            self._header_write = None
        if not write.cancelled():
            write.result()

    async def _write(self, request: codec_pb2.DecodeRequest) -> None:
        try:
            await self._call.write(request)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the call is dead; chunks() sees it and fails over with every owed frame

    async def _done_writing(self) -> None:
        try:
            await self._call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass

    def _resume_from(self) -> int:
        """The first frame a resume sends: 3 before the frame of the first owed sample (the context
        that rebuilds the decoder's state exactly), or the oldest frame kept."""
        return max(self._frames_start, self._delivered // FRAME_SAMPLES - RESUME_CONTEXT_FRAMES)

    def _trim(self) -> None:
        """Forget frames no resume can need."""
        keep_from = self._resume_from()
        if keep_from - self._frames_start > 64:
            self._frames = self._frames[keep_from - self._frames_start :]
            self._frames_start = keep_from

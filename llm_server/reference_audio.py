"""A clone's reference recording -> 24 kHz mono float32, in bounded work, off the worker's event loop.

A recording is whatever a client uploads, so its cost is decided by the file: the container's streams and
declared duration, its sample rate and channels, how many packets it is cut into. Each is checked before
or while decoding, in one pass with a running sample count, so a hostile file is refused after bounded work
(a 3 s FLAC in 72,000 16-sample blocks took a worker's event loop 54 s when the samples were re-summed per
frame on it). The decode runs in a process of its own, forked from a server process that has the decoder
imported already (multiprocessing's forkserver: neither a fork of the engine's process nor a fresh
interpreter per upload), killed at its deadline; at most `slots` at once per worker.
"""

from __future__ import annotations

import asyncio
import io
import math
import multiprocessing
import multiprocessing.forkserver
import os
import resource
from dataclasses import dataclass

import av
import numpy as np
import soxr

from codec_contract.audio import SAMPLE_RATE


class ReferenceRefused(Exception):
    """A recording that cannot be a reference, and why (a 400 to the client)."""


class UploadsBusy(Exception):
    """Every decode slot of the worker is taken (a 429 to the client)."""


@dataclass(frozen=True)
class ReferenceBounds:
    max_s: float = 30.0  # the longest reference, declared or decoded
    min_s: float = 0.25  # a shorter one is no voice to clone
    max_rate: int = 192_000  # studio rates decode; above, a file built to cost
    max_channels: int = 8
    max_streams: int = 16  # streams in the container (a video with a few audio tracks is fine)
    packets_per_s: int = 500  # packets per second of max_s: frames of 2 ms on average (Opus goes to 2.5 ms)

    @property
    def max_packets(self) -> int:
        return int(self.packets_per_s * self.max_s)


def decode_reference(data: bytes, bounds: ReferenceBounds) -> np.ndarray:
    """A recording in any format PyAV reads -> 24 kHz mono float32 in [-1, 1]; ReferenceRefused saying why not."""
    try:
        with av.open(io.BytesIO(data)) as container:  # what it declares, and its packets counted, not decoded
            _count_packets(container, _audio_stream(container, bounds), bounds)
        with av.open(io.BytesIO(data)) as container:
            rate, pieces = _decoded(container, container.streams.audio[0], bounds)
    except av.FFmpegError as exc:
        raise ReferenceRefused(f"the audio could not be decoded: {exc}") from None
    pcm = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
    if not pcm.size or not np.isfinite(pcm).all() or np.abs(pcm).max() < 1e-4:
        raise ReferenceRefused("the recording holds no sound")
    if pcm.size < bounds.min_s * rate:
        raise ReferenceRefused(f"the recording is {pcm.size / rate:.2f} s long; a reference needs at least "
                               f"{bounds.min_s:g} s (5 to 15 s is best)")
    if rate != SAMPLE_RATE:
        pcm = soxr.resample(pcm, rate, SAMPLE_RATE)
    return np.clip(pcm, -1.0, 1.0).astype(np.float32)


def _audio_stream(container, bounds: ReferenceBounds):
    """The first audio stream, once what the container declares is within bounds."""
    if len(container.streams) > bounds.max_streams:
        raise ReferenceRefused(f"the file holds {len(container.streams)} streams; at most {bounds.max_streams}")
    if not container.streams.audio:
        raise ReferenceRefused("the file holds no audio stream")
    stream = container.streams.audio[0]
    _check_format(stream.codec_context.sample_rate, stream.codec_context.channels, bounds)
    declared = _declared_s(container, stream)
    if declared is not None and declared > bounds.max_s:
        raise ReferenceRefused(_too_long(bounds, f"declares {declared:.1f} s"))
    return stream


def _check_format(rate: int | None, channels: int | None, bounds: ReferenceBounds) -> None:
    if rate and rate > bounds.max_rate:
        raise ReferenceRefused(f"a sample rate of {rate} Hz; at most {bounds.max_rate} Hz")
    if channels and channels > bounds.max_channels:
        raise ReferenceRefused(f"{channels} channels; at most {bounds.max_channels}")


def _declared_s(container, stream) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / av.time_base
    return None


def _count_packets(container, stream, bounds: ReferenceBounds) -> None:
    """Refused when the stream is cut into more than max_packets packets: demuxing costs a fraction of decoding,
    so a file of tiny frames is refused before any is decoded."""
    for packets, _ in enumerate(container.demux(stream), 1):
        if packets > bounds.max_packets:
            raise ReferenceRefused(f"the recording is cut into more than {bounds.max_packets} packets (frames of "
                                   f"under {1000 / bounds.packets_per_s:g} ms): re-encode it with ordinary frames")


def _decoded(container, stream, bounds: ReferenceBounds) -> tuple[int, list[np.ndarray]]:
    """Its audio as mono float32 pieces at its own rate, counted as it comes: refused past max_s of samples, or
    when the rate or the channels change mid-stream past the bounds."""
    to_mono = av.AudioResampler(format="flt", layout="mono")  # packed float32, the rate as it is
    pieces: list[np.ndarray] = []
    rate, samples = None, 0
    for packet in container.demux(stream):
        for frame in packet.decode():
            if rate is None:
                rate = frame.sample_rate
            elif frame.sample_rate != rate:
                raise ReferenceRefused(f"the sample rate changes mid-stream ({rate} to {frame.sample_rate} Hz)")
            _check_format(frame.sample_rate, len(frame.layout.channels), bounds)
            samples += frame.samples
            if samples > bounds.max_s * rate:
                raise ReferenceRefused(_too_long(bounds, "is"))
            pieces += [f.to_ndarray().reshape(-1) for f in to_mono.resample(frame)]
    pieces += [f.to_ndarray().reshape(-1) for f in to_mono.resample(None)]
    return rate or SAMPLE_RATE, pieces


def _too_long(bounds: ReferenceBounds, says: str) -> str:
    return f"the recording {says} longer than {bounds.max_s:g} s; a reference of 5 to 15 s is best"


def _lowest_priority(cpu_s: float) -> None:
    """The highest niceness (the engine and the codec replicas take the cores first; not SCHED_IDLE, which a CPU
    engine busy with streams would starve it under for good), and at most `cpu_s` of CPU (the kernel's backstop
    to the deadline)."""
    os.nice(19)
    limit = max(1, math.ceil(cpu_s))
    resource.setrlimit(resource.RLIMIT_CPU, (limit, limit))


def _decode_child(out, data: bytes, bounds: ReferenceBounds, cpu_s: float) -> None:
    """In the decoding process: the result, or the refusal's reason, down the pipe. At the lowest priority: where
    the cores are few (a CPU worker) the engine and the codec replicas come first."""
    _lowest_priority(cpu_s)
    try:
        out.send(("ok", decode_reference(data, bounds).tobytes()))
    except ReferenceRefused as exc:
        out.send(("refused", str(exc)))
    except Exception as exc:  # a decoder bug is the file's problem to the client, and never the worker's
        out.send(("refused", f"the audio could not be decoded: {type(exc).__name__}: {exc}"))


class ReferenceDecoder:
    """decode_reference in a process of its own, within a deadline, at most `slots` at once."""

    def __init__(self, bounds: ReferenceBounds, timeout_s: float = 10.0, slots: int = 2) -> None:
        self.bounds, self.timeout_s, self.slots = bounds, timeout_s, slots
        self.busy = 0
        self._context = multiprocessing.get_context("forkserver")
        # The server process imports this module (PyAV, NumPy, soxr) once; it is never the engine's process.
        self._context.set_forkserver_preload([__name__])

    def warm(self) -> None:
        """Start the server process now (a worker that takes uploads, at start-up): its interpreter and imports
        cost a second or two of CPU, which the first upload would otherwise take from the streams playing."""
        multiprocessing.forkserver.ensure_running()

    async def decode(self, data: bytes) -> np.ndarray:
        """The recording's PCM; ReferenceRefused (with why, the deadline included) or UploadsBusy."""
        if self.busy >= self.slots:
            raise UploadsBusy(f"{self.busy} reference recordings are being decoded on this worker; retry shortly")
        self.busy += 1
        try:
            return await self._decode(data)
        finally:
            self.busy -= 1

    async def _decode(self, data: bytes) -> np.ndarray:
        receiving, sending = self._context.Pipe(duplex=False)
        process = self._context.Process(target=_decode_child, args=(sending, data, self.bounds, self.timeout_s),
                                            daemon=True)
        try:
            await asyncio.to_thread(process.start)  # the first start also starts the server process
            sending.close()  # ours; the child's end closing (it died) ends the wait below
            if not await asyncio.to_thread(receiving.poll, self.timeout_s):
                raise ReferenceRefused(f"the recording took over {self.timeout_s:g} s to decode; re-encode it as a "
                                       "plain WAV, FLAC, MP3 or Opus file")
            try:
                status, value = await asyncio.to_thread(receiving.recv)
            except EOFError:
                raise ReferenceRefused("the audio could not be decoded (the decoder died)") from None
        finally:
            if process.pid is not None:
                process.kill()
                await asyncio.to_thread(process.join)
            receiving.close()
            sending.close()
        if status != "ok":
            raise ReferenceRefused(value)
        return np.frombuffer(value, np.float32)

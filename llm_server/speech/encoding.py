"""Speech bytes in the format a client asked for, encoded as the audio arrives.

The codec tier sends 24 kHz mono s16le. A client may want it resampled (8 to 48 kHz: python-soxr's
streaming resampler, exact passthrough at 24 kHz), as raw PCM (s16le, f32le), as telephony μ-law or
A-law, or in a container (mp3, Ogg Opus, AAC in ADTS, FLAC, WAV): PyAV encodes and muxes each chunk
into a write-only sink that is drained after every chunk, so the first bytes go out with the first
audio. The sink cannot seek, so no muxer goes back to patch a header: WAV and FLAC say "length
unknown", MP3 has no Xing frame. MP3 and AAC add the encoder's priming (about a frame) at the start.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np
import soxr

from codec_contract.audio import SAMPLE_RATE

S16_BYTES = 2  # the codec tier's s16le, and `pcm` to clients
SAMPLE_RATES = (8000, 16000, 22050, 24000, 32000, 44100, 48000)
# container, encoder, muxer options, bit rate (None: lossless or raw)
_CONTAINERS = {
    "mp3": ("mp3", "libmp3lame", {"id3v2_version": "0", "write_xing": "0"}, 64_000),
    "opus": ("ogg", "libopus", {"page_duration": "20000"}, 48_000),  # 20 ms pages: Ogg's default 1 s stalls a stream
    "aac": ("adts", "aac", {}, 64_000),
    "flac": ("flac", "flac", {"metadata_header_padding": "0"}, None),
    "wav": ("wav", "pcm_s16le", {}, None),
    "mulaw": ("mulaw", "pcm_mulaw", {}, None),
    "alaw": ("alaw", "pcm_alaw", {}, None),
}
_CODEC_OPTIONS = {
    "flac": {"frame_size": "1024"},  # a FLAC frame per 1024 samples, not 4608: bytes out every chunk
    # LAME's bit reservoir holds each frame back until later frames are encoded: without it the first
    # bytes leave with the first chunk instead of the second (benchmarks/soak.py --doors, ttfb_s).
    "mp3": {"reservoir": "0"},
}
# Lossy encoders cost a millisecond or two a chunk (MP3 at 44.1 kHz 1.6 ms for 85 ms of audio, ElevenLabs'
# default format): on the event loop, fifty such streams would fill it. They run on threads instead (PyAV
# releases the GIL while libavcodec encodes); the others cost less than the hand-off.
_OFF_LOOP = frozenset({"mp3", "opus", "aac"})
_ENCODING = ThreadPoolExecutor(max_workers=os.cpu_count() or 2, thread_name_prefix="encode")
_OPUS_RATES = (8000, 12000, 16000, 24000, 48000)  # libopus takes no other; 22.05 and 44.1 kHz become 48 kHz
MEDIA_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac", "wav": "audio/wav",
               "pcm": "audio/pcm", "pcm_f32le": "audio/pcm", "mulaw": "audio/basic", "alaw": "audio/x-alaw-basic"}


class UnsupportedOutput(ValueError):
    """A format or sample rate this server does not produce (the client's mistake: a 4xx)."""


@dataclass(frozen=True)
class AudioOutput:
    """What a client gets: `pcm` (s16le), `pcm_f32le`, `mulaw`, `alaw`, or a container, at `sample_rate`."""

    format: str = "pcm"
    sample_rate: int = SAMPLE_RATE

    def __post_init__(self) -> None:
        if self.format not in MEDIA_TYPES:
            raise UnsupportedOutput(f"format {self.format!r} is not one of {sorted(MEDIA_TYPES)}")
        if self.sample_rate not in SAMPLE_RATES:
            raise UnsupportedOutput(f"sample_rate {self.sample_rate} is not one of {list(SAMPLE_RATES)}")

    @property
    def media_type(self) -> str:
        return MEDIA_TYPES[self.format]

    @property
    def encoded_rate(self) -> int:
        """The rate the bytes are at (Opus cannot do 22.05 or 44.1 kHz: those become 48 kHz)."""
        if self.format == "opus" and self.sample_rate not in _OPUS_RATES:
            return 48_000
        return self.sample_rate


class _Sink:
    """A write-only, non-seekable file for PyAV: muxers never seek back; drain() takes what was written."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def write(self, data: bytes) -> int:
        self._buffer += data
        return len(data)

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def drain(self) -> bytes:
        out = bytes(self._buffer)
        self._buffer.clear()
        return out


class StreamEncoder:
    """24 kHz s16le in, chunk by chunk; the client's bytes out as soon as the encoder has them."""

    def __init__(self, output: AudioOutput) -> None:
        self.output = output
        rate = output.encoded_rate
        self._resampler = None if rate == SAMPLE_RATE else soxr.ResampleStream(SAMPLE_RATE, rate, 1, dtype="float32")
        self._container = None
        if output.format in _CONTAINERS:
            name, codec, options, bit_rate = _CONTAINERS[output.format]
            self._sink = _Sink()
            self._container = av.open(self._sink, mode="w", format=name, container_options={**options, "fflags": "+bitexact"})
            self._stream = self._container.add_stream(codec, rate=rate, layout="mono",
                                                      options=_CODEC_OPTIONS.get(output.format, {}))
            if bit_rate:
                self._stream.bit_rate = bit_rate
            self._container.start_encoding()  # the header goes out with the first chunk, not the first packet
            self._pts = 0

    async def encode_chunk(self, s16: bytes) -> bytes:
        """encode(), on an encoding thread for the lossy formats; one call at a time per stream (the caller awaits)."""
        if self.output.format not in _OFF_LOOP:
            return self.encode(s16)
        return await asyncio.get_running_loop().run_in_executor(_ENCODING, self.encode, s16)

    async def finish_stream(self) -> bytes:
        """finish(), where encode_chunk() runs."""
        if self.output.format not in _OFF_LOOP:
            return self.finish()
        return await asyncio.get_running_loop().run_in_executor(_ENCODING, self.finish)

    def encode(self, s16: bytes) -> bytes:
        """Encode a chunk of 24 kHz s16le PCM (24 kHz s16le out is the bytes themselves)."""
        if self._resampler is None and self.output.format == "pcm":
            return s16
        pcm = np.frombuffer(s16, dtype="<i2").astype(np.float32) / 32768.0
        if self._resampler is not None:
            pcm = self._resampler.resample_chunk(pcm, last=False)
        return self._write(pcm)

    def finish(self) -> bytes:
        """The end of the stream: what the resampler held back, the encoder's last frames, the trailer."""
        out = b""
        if self._resampler is not None:
            out += self._write(self._resampler.resample_chunk(np.zeros(0, np.float32), last=True))
        if self._container is not None:
            self._container.mux(self._stream.encode(None))
            self._container.close()
            out += self._sink.drain()
        return out

    def _write(self, pcm: np.ndarray) -> bytes:
        if self.output.format == "pcm":
            return np.round(np.clip(pcm, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
        if self.output.format == "pcm_f32le":
            return pcm.astype("<f4").tobytes()
        if len(pcm):  # PyAV converts to the encoder's sample format and re-chunks to its frame size
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm, dtype=np.float32).reshape(1, -1),
                                               format="flt", layout="mono")
            frame.sample_rate = self.output.encoded_rate
            frame.time_base = Fraction(1, frame.sample_rate)
            frame.pts = self._pts
            self._pts += len(pcm)
            self._container.mux(self._stream.encode(frame))
        return self._sink.drain()


@dataclass(frozen=True)
class SilenceTrim:
    """Drop the near silence Orpheus often opens with: samples before the first one above `threshold_dbfs`,
    at most `max_ms` of them."""

    threshold_dbfs: float = -40.0
    max_ms: float = 500.0

    @property
    def level(self) -> int:
        """The threshold as an s16 amplitude."""
        return int(32767 * 10 ** (self.threshold_dbfs / 20))


def first_audible(s16: bytes, level: int) -> int | None:
    """Index of the first sample whose magnitude reaches `level`, or None."""
    loud = np.flatnonzero(np.abs(np.frombuffer(s16, dtype="<i2").astype(np.int32)) >= level)
    return int(loud[0]) if loud.size else None


def sse_event(event: dict) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {json.dumps(event)}\n\n".encode()


def sse_delta(audio: bytes) -> bytes:
    """One `speech.audio.delta` event carrying base64 audio in the requested format, as OpenAI streams it."""
    return sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(audio).decode()})


def sse_done(input_tokens: int, output_tokens: int) -> bytes:
    """The closing `speech.audio.done` event with token usage."""
    usage = {"input_tokens": input_tokens, "output_tokens": output_tokens, "total_tokens": input_tokens + output_tokens}
    return sse_event({"type": "speech.audio.done", "usage": usage})

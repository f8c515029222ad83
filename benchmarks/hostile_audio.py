"""A hostile corpus of reference recordings for POST /v1/voices: files built to cost a decoder (tiny frames,
extreme rates and channel counts, many streams, an hour that compresses to a few MiB), files whose headers lie,
files cut short or corrupted, and bytes that are no audio at all. Each generator returns the file's bytes, made in
memory with PyAV (its bundled FFmpeg) and NumPy; nothing is written to disk. Generators are cached: the corpus is
made once per test session, and only the items a run uses.

How a tiny frame is made: FFmpeg's FLAC encoder takes its block size from the codec context's generic
`frame_size` option (16 is FLAC's smallest block), which PyAV passes at open through `codec_context.options`
(the attribute itself is read-only); libopus takes `frame_duration` (2.5 ms is Opus's shortest). MP3 cannot have
tiny frames: a frame is 1152 samples (MPEG-1) or 576 (MPEG-2/2.5, at 24 kHz and below), so at most ~83 packets a
second; its costly case is a long file, not a fine-cut one.
"""

from __future__ import annotations

import functools
import io
import struct
import wave
from fractions import Fraction

import av
import numpy as np

MAX_REFERENCE_BYTES = 16 << 20  # the worker's default max_reference_bytes


class EncoderMissing(Exception):
    """PyAV's bundled FFmpeg lacks an encoder a generator needs (the test skips the item, saying which)."""


def needs(*codecs: str):
    """Mark a generator with the encoders it uses: `fn.requires`, checked against av.codecs_available when called."""
    def mark(fn):
        fn.requires = codecs
        return fn
    return mark


def missing(fn) -> str | None:
    """Why `fn` cannot run here (an encoder PyAV's FFmpeg lacks), or None."""
    lacking = [c for c in getattr(fn, "requires", ()) if c not in av.codecs_available]
    return f"PyAV's FFmpeg has no {', '.join(lacking)} encoder" if lacking else None


# --- building blocks -----------------------------------------------------------------------------------------

def tone(n: int, rate: int, amplitude: float = 0.3, start: int = 0, hz: float = 220.0) -> np.ndarray:
    """n samples of a sine at `hz`, float64 in [-amplitude, amplitude], from sample `start`."""
    return amplitude * np.sin(2 * np.pi * hz * (np.arange(n) + start) / rate)


class _Unseekable(io.RawIOBase):
    """A write-only, unseekable output: a muxer cannot go back to write the duration into the header."""

    def __init__(self) -> None:
        self.buffer = io.BytesIO()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def write(self, data) -> int:
        return self.buffer.write(data)


def encoded(fmt: str, codec: str, seconds: float, rate: int, layout: str = "mono", sample_format: str = "s16",
            amplitude: float = 0.3, options: dict[str, str] | None = None, bit_rate: int | None = None,
            seekable: bool = True) -> bytes:
    """`seconds` of a tone encoded with `codec` (its `options` given at open) into container `fmt`, in memory;
    `seekable=False`: muxed to an unseekable output (no duration written back into the header)."""
    out = io.BytesIO() if seekable else _Unseekable()
    container = av.open(out, "w", format=fmt)
    try:
        stream = container.add_stream(codec, rate=rate, layout=layout)
        stream.codec_context.format = sample_format
        if bit_rate:
            stream.codec_context.bit_rate = bit_rate
        if options:
            stream.codec_context.options = dict(options)
        stream.codec_context.open()
        channels = stream.codec_context.channels
        total, step = int(seconds * rate), rate  # a second a frame: PyAV re-frames to the encoder's frame_size
        for start in range(0, total, step):
            x = tone(min(step, total - start), rate, amplitude, start)
            samples = (x * 32767).astype("<i2") if sample_format.startswith("s16") else x.astype("<f4")
            if sample_format.endswith("p"):  # planar: one row a channel
                array = np.repeat(samples[None, :], channels, axis=0)
            else:  # packed: the channels interleaved in one row
                array = np.repeat(samples[:, None], channels, axis=1).reshape(1, -1)
            frame = av.AudioFrame.from_ndarray(array, format=sample_format, layout=layout)
            frame.sample_rate, frame.pts, frame.time_base = rate, start, Fraction(1, rate)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    finally:
        container.close()
    return out.buffer.getvalue() if isinstance(out, _Unseekable) else out.getvalue()


def wav_file(seconds: float, rate: int = 48000, channels: int = 1, amplitude: float = 0.3) -> bytes:
    """A plain s16 WAV (the `wave` module) of a tone, any rate and channel count the header can say."""
    samples = (tone(int(seconds * rate), rate, amplitude) * 32767).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.repeat(samples[:, None], channels, axis=1).tobytes())
    return out.getvalue()


def _wav_claiming(data: bytes, data_bytes: int) -> bytes:
    """A WAV of `wave` whose RIFF and data chunk sizes are patched to say `data_bytes` of samples."""
    assert data[:4] == b"RIFF" and data[36:40] == b"data", "the canonical 44-byte header"
    patched = bytearray(data)
    patched[4:8] = struct.pack("<I", min(data_bytes + 36, 0xFFFFFFFF))
    patched[40:44] = struct.pack("<I", data_bytes)
    return bytes(patched)


STREAMINFO = 8  # "fLaC", then the first metadata block's 4-byte header: STREAMINFO's 34 bytes start here


def _flac_without_total_samples(data: bytes) -> bytes:
    """A FLAC whose STREAMINFO says 0 total samples ("unknown"), its MD5 zeroed: no declared duration."""
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0, "STREAMINFO first"
    patched = bytearray(data)
    patched[STREAMINFO + 13] &= 0xF0  # the 36-bit total: the low 4 bits of byte 13, then bytes 14..17
    patched[STREAMINFO + 14:STREAMINFO + 18] = bytes(4)
    patched[STREAMINFO + 18:STREAMINFO + 34] = bytes(16)
    return bytes(patched)


def _flac_streaminfo_rate(data: bytes, rate: int) -> bytes:
    """A FLAC whose STREAMINFO's 20-bit sample rate is patched to `rate` (its frames' headers say otherwise)."""
    patched = bytearray(data)
    packed = int.from_bytes(patched[STREAMINFO + 10:STREAMINFO + 13], "big")
    patched[STREAMINFO + 10:STREAMINFO + 13] = ((rate << 4) | (packed & 0xF)).to_bytes(3, "big")
    return bytes(patched)


def packets(data: bytes) -> int:
    """How many packets the demuxer cuts a file's first audio stream into (the decoder's packet count)."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        return sum(1 for packet in container.demux(stream) if packet.size)


# --- tiny frames -----------------------------------------------------------------------------------------------

@functools.cache
@needs("flac")
def flac_tiny_frames_384k() -> bytes:
    """The attack that froze a worker: 3 s of a quiet tone at 384 kHz in 16-sample FLAC blocks (72,000 frames)."""
    return encoded("flac", "flac", 3.0, 384_000, amplitude=0.05, options={"frame_size": "16"})


@functools.cache
@needs("flac")
def flac_tiny_frames_384k_declared_48k() -> bytes:
    """The 384 kHz tiny-frame FLAC with STREAMINFO claiming 48 kHz (its frame headers still say 384 kHz)."""
    return _flac_streaminfo_rate(flac_tiny_frames_384k(), 48_000)


@functools.cache
@needs("flac")
def flac_tiny_frames_48k() -> bytes:
    """10 s at a legal 48 kHz in 16-sample FLAC blocks: 30,000 packets, twice max_packets (15,000)."""
    return encoded("flac", "flac", 10.0, 48_000, amplitude=0.05, options={"frame_size": "16"})


@functools.cache
@needs("flac")
def flac_tiny_frames_48k_within_bounds() -> bytes:
    """4.5 s at 48 kHz in 16-sample FLAC blocks: 13,500 packets, under max_packets (decodes, as it should)."""
    return encoded("flac", "flac", 4.5, 48_000, options={"frame_size": "16"})


@functools.cache
@needs("libopus")
def opus_tiny_frames() -> bytes:
    """40 s of Opus in 2.5 ms frames (16,000 packets) in Ogg, which declares its 40 s (the last page's granule)."""
    return encoded("ogg", "libopus", 40.0, 48_000, sample_format="flt", options={"frame_duration": "2.5"})


@functools.cache
@needs("libopus")
def opus_tiny_frames_undeclared() -> bytes:
    """40 s of Opus in 2.5 ms frames in WebM muxed unseekably: no duration in the header, 16,000 packets."""
    return encoded("webm", "libopus", 40.0, 48_000, sample_format="flt", options={"frame_duration": "2.5"},
                   seekable=False)


@functools.cache
@needs("libopus")
def opus_tiny_frames_within_bounds() -> bytes:
    """5 s of Opus in 2.5 ms frames (2,000 packets) in Ogg: Opus's finest cut, legal (decodes)."""
    return encoded("ogg", "libopus", 5.0, 48_000, sample_format="flt", options={"frame_duration": "2.5"})


@functools.cache
@needs("libmp3lame")
def mp3_long() -> bytes:
    """MP3 cannot have tiny frames (576 samples at 8 kHz): instead 40 s of 8 kHz MP3 at 8 kbit/s (~560 frames)."""
    return encoded("mp3", "libmp3lame", 40.0, 8_000, sample_format="s16p", bit_rate=8_000)


# --- rates and channels ------------------------------------------------------------------------------------------

@functools.cache
def wav_192k() -> bytes:
    """2 s of WAV at 192 kHz: the highest rate a reference may have (decodes)."""
    return wav_file(2.0, 192_000)


@functools.cache
def wav_384k() -> bytes:
    """1 s of WAV at 384 kHz: over max_rate."""
    return wav_file(1.0, 384_000)


@functools.cache
def wav_768k() -> bytes:
    """1 s of WAV at 768 kHz: over max_rate."""
    return wav_file(1.0, 768_000)


@functools.cache
def wav_8_channels() -> bytes:
    """2 s of 8-channel WAV at 16 kHz: the most channels a reference may have (decodes)."""
    return wav_file(2.0, 16_000, channels=8)


@functools.cache
def wav_16_channels() -> bytes:
    """1 s of 16-channel WAV at 16 kHz: over max_channels."""
    return wav_file(1.0, 16_000, channels=16)


@functools.cache
def wav_32_channels() -> bytes:
    """1 s of 32-channel WAV at 16 kHz: over max_channels."""
    return wav_file(1.0, 16_000, channels=32)


# --- declared durations that lie ---------------------------------------------------------------------------------

@functools.cache
def wav_claims_2s_holds_40s() -> bytes:
    """A 8 kHz WAV whose RIFF and data sizes say 2 s, followed by 38 s more of samples (read as trailing junk)."""
    return _wav_claiming(wav_file(40.0, 8_000), 2 * 8_000 * 2)


@functools.cache
def wav_unknown_length_holds_40s() -> bytes:
    """A 8 kHz WAV whose data size is 0xFFFFFFFF (a streamed WAV's "unknown") holding 40 s of samples."""
    return _wav_claiming(wav_file(40.0, 8_000), 0xFFFFFFFF)


@functools.cache
def wav_claims_1h_holds_2s() -> bytes:
    """A 8 kHz WAV whose RIFF and data sizes say an hour, holding 2 s of samples."""
    return _wav_claiming(wav_file(2.0, 8_000), 3600 * 8_000 * 2)


# --- an hour of near-silence inside the byte limit -----------------------------------------------------------------

@functools.cache
@needs("flac")
def flac_hour_of_near_silence() -> bytes:
    """An hour of an 8 LSB tone at 8 kHz mono as FLAC (~7 MiB, under max_reference_bytes), its hour declared."""
    data = encoded("flac", "flac", 3600.0, 8_000, amplitude=8 / 32767, options={"frame_size": "4608"})
    assert len(data) < MAX_REFERENCE_BYTES, len(data)
    return data


@functools.cache
@needs("flac")
def flac_hour_of_near_silence_undeclared() -> bytes:
    """The hour of near-silence with STREAMINFO's total samples zeroed: no declared duration at all."""
    return _flac_without_total_samples(flac_hour_of_near_silence())


# --- truncated and corrupt -------------------------------------------------------------------------------------

@functools.cache
@needs("flac")
def flac_2s() -> bytes:
    """2 s of an ordinary 48 kHz FLAC (the base of the truncated and corrupt ones)."""
    return encoded("flac", "flac", 2.0, 48_000)


@functools.cache
@needs("libmp3lame")
def mp3_2s() -> bytes:
    """2 s of an ordinary 48 kHz MP3 (the base of the truncated ones)."""
    return encoded("mp3", "libmp3lame", 2.0, 48_000, sample_format="s16p")


@functools.cache
@needs("flac")
def flac_cut_at_half() -> bytes:
    """The 2 s FLAC cut at half its bytes (mid-frame)."""
    data = flac_2s()
    return data[:len(data) // 2]


@functools.cache
@needs("flac")
def flac_cut_at_100_bytes() -> bytes:
    """The 2 s FLAC cut at 100 bytes (its headers, no frame)."""
    return flac_2s()[:100]


@functools.cache
@needs("libmp3lame")
def mp3_cut_at_half() -> bytes:
    """The 2 s MP3 cut at half its bytes."""
    data = mp3_2s()
    return data[:len(data) // 2]


@functools.cache
@needs("libmp3lame")
def mp3_cut_at_100_bytes() -> bytes:
    """The 2 s MP3 cut at 100 bytes."""
    return mp3_2s()[:100]


@functools.cache
def wav_cut_at_half() -> bytes:
    """2 s of 48 kHz WAV cut at half its bytes (its header still says 2 s)."""
    data = wav_file(2.0)
    return data[:len(data) // 2]


@functools.cache
def wav_cut_at_100_bytes() -> bytes:
    """2 s of 48 kHz WAV cut at 100 bytes: its header and 28 samples (0.6 ms)."""
    return wav_file(2.0)[:100]


@functools.cache
@needs("flac")
def flac_corrupt_middle() -> bytes:
    """The 2 s FLAC with 64 bytes inverted within 2 KB of its middle (a few frames fail their CRC)."""
    data = bytearray(flac_2s())
    rng = np.random.default_rng(7)
    middle = len(data) // 2
    for i in rng.integers(middle - 2000, middle + 2000, 64):
        data[i] ^= 0xFF
    return bytes(data)


@functools.cache
@needs("flac")
def flac_corrupt_throughout() -> bytes:
    """The 2 s FLAC with 2,000 random bytes overwritten after its headers."""
    data = bytearray(flac_2s())
    rng = np.random.default_rng(8)
    for i in rng.integers(200, len(data), 2000):
        data[i] = int(rng.integers(256))
    return bytes(data)


# --- containers with many streams, and video --------------------------------------------------------------------

def _audio_streams(count: int, seconds: float = 0.5, rate: int = 8_000) -> bytes:
    """Matroska holding `count` PCM audio streams, each `seconds` of a tone."""
    out = io.BytesIO()
    with av.open(out, "w", format="matroska") as container:
        streams = [container.add_stream("pcm_s16le", rate=rate, layout="mono") for _ in range(count)]
        samples = (tone(int(seconds * rate), rate) * 32767).astype("<i2")[None, :]
        for stream in streams:
            frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
            frame.sample_rate, frame.pts = rate, 0
            for packet in [*stream.encode(frame), *stream.encode(None)]:
                container.mux(packet)
    return out.getvalue()


@functools.cache
def mkv_16_audio_streams() -> bytes:
    """Matroska with 16 audio streams of 0.5 s: the most streams a file may hold (its first decodes)."""
    return _audio_streams(16)


@functools.cache
def mkv_20_audio_streams() -> bytes:
    """Matroska with 20 audio streams of 0.5 s: over max_streams."""
    return _audio_streams(20)


def _video(seconds: float, with_audio: bool) -> bytes:
    """MP4 of a 64x64 H.264 video at 10 fps (MPEG-4 Part 2 without libx264), with a track of AAC audio or not."""
    video_codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        video = container.add_stream(video_codec, rate=10)
        video.width, video.height, video.pix_fmt = 64, 64, "yuv420p"
        audio = container.add_stream("aac", rate=48_000, layout="mono") if with_audio else None
        for i in range(int(seconds * 10)):
            image = av.VideoFrame.from_ndarray(np.full((64, 64, 3), i * 10 % 256, np.uint8), format="rgb24")
            image.pts = i
            for packet in video.encode(image):
                container.mux(packet)
        for packet in video.encode(None):
            container.mux(packet)
        if audio is not None:
            total, step = int(seconds * 48_000), 1024
            x = tone(total, 48_000).astype("<f4")
            for start in range(0, total, step):
                frame = av.AudioFrame.from_ndarray(x[None, start:start + step], format="fltp", layout="mono")
                frame.sample_rate, frame.pts = 48_000, start
                for packet in audio.encode(frame):
                    container.mux(packet)
            for packet in audio.encode(None):
                container.mux(packet)
    return out.getvalue()


@functools.cache
@needs("aac")
def mp4_video_and_audio() -> bytes:
    """MP4 with a 2 s video stream and a 2 s AAC audio stream (a reference may come from a video: decodes)."""
    return _video(2.0, with_audio=True)


@functools.cache
def mp4_video_only() -> bytes:
    """MP4 with only a 2 s video stream."""
    return _video(2.0, with_audio=False)


# --- not audio at all --------------------------------------------------------------------------------------------

@functools.cache
def png_header_and_noise() -> bytes:
    """A PNG signature followed by 4,000 random bytes (sent as audio/wav)."""
    return b"\x89PNG\r\n\x1a\n" + np.random.default_rng(9).bytes(4000)


@functools.cache
def text_file() -> bytes:
    """A text file (sent as audio/wav)."""
    return b"This is not a recording; it is a line of text, fifty times over.\n" * 50


@functools.cache
def zero_bytes() -> bytes:
    """An empty file (sent as audio/wav)."""
    return b""


@functools.cache
def random_bytes() -> bytes:
    """10,000 random bytes (sent as audio/wav)."""
    return np.random.default_rng(10).bytes(10_000)


def over_the_byte_limit() -> bytes:
    """A WAV header and silence to one byte over max_reference_bytes (the body limit refuses it unread)."""
    head = wav_file(0.0, 8_000)
    return _wav_claiming(head, MAX_REFERENCE_BYTES) + bytes(MAX_REFERENCE_BYTES + 1 - len(head))


def corpus() -> dict[str, object]:
    """Every item of the corpus: its generator's name -> the generator (building blocks and bases left out)."""
    bases = {"flac_2s", "mp3_2s"}
    return {name: fn for name, fn in globals().items()
            if callable(fn) and getattr(fn, "__module__", None) == __name__ and hasattr(fn, "__wrapped__")
            and name not in bases} | {"over_the_byte_limit": over_the_byte_limit}

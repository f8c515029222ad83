"""`megapod say`: speak text through any running endpoint and save or pipe the audio."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import BinaryIO

import httpx

SAMPLE_RATE, SAMPLE_BYTES, WAV_HEADER_BYTES = 24_000, 2, 44


@dataclass
class SayResult:
    """What the listener got: time to first audio, audio length, and how fast it came."""

    first_audio_s: float
    audio_s: float
    wall_s: float

    @property
    def real_time_factor(self) -> float:
        """Wall time over audio time: below 1 means faster than real time."""
        return self.wall_s / self.audio_s if self.audio_s else float("inf")


def say(endpoint: str, text: str, voice: str, out: BinaryIO, response_format: str, seed: int | None,
        progress: BinaryIO | None = sys.stderr) -> SayResult:
    """Stream speech for `text` into `out`, printing a progress line to `progress`."""
    body = {"model": "orpheus", "input": text, "voice": voice, "response_format": response_format}
    if seed is not None:
        body["seed"] = seed
    started = time.perf_counter()
    first = None
    audio_bytes = 0
    header = WAV_HEADER_BYTES if response_format == "wav" else 0
    with httpx.stream("POST", f"{endpoint.rstrip('/')}/v1/audio/speech", json=body, timeout=httpx.Timeout(10.0, read=300.0)) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{r.status_code}: {r.json().get('error', {}).get('message', r.text)}")
        for chunk in r.iter_bytes():
            out.write(chunk)
            audio_bytes += len(chunk)
            first = first or time.perf_counter() - started
            if progress is not None:
                _progress(progress, first, max(0, audio_bytes - header), time.perf_counter() - started)
    out.flush()
    result = SayResult(first or 0.0, max(0, audio_bytes - header) / (SAMPLE_RATE * SAMPLE_BYTES), time.perf_counter() - started)
    if progress is not None:
        _progress(progress, result.first_audio_s, max(0, audio_bytes - header), result.wall_s)
        progress.write("\n")
    return result


def _progress(stream, first_s: float, audio_bytes: int, wall_s: float) -> None:
    audio_s = audio_bytes / (SAMPLE_RATE * SAMPLE_BYTES)
    rtf = wall_s / audio_s if audio_s else float("inf")
    stream.write(f"\rfirst audio {first_s * 1000:.0f} ms | {audio_s:.2f} s of audio in {wall_s:.2f} s | real-time factor {rtf:.2f}  ")
    stream.flush()

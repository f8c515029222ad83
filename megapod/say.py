"""`megapod say`: speak text through any running endpoint, by any of its front doors, and save or pipe the audio.

`openai` (the default) posts to /v1/audio/speech and takes the format asked for; the socket doors speak their
own protocol as their vendors' clients do (Cartesia's, Deepgram's and ElevenLabs' WebSockets, Baseten's, Together's,
vLLM-Omni's speech socket, SLNG's Unmute Bridge) and give 24 kHz PCM, written raw or in a WAV file."""

from __future__ import annotations

import base64
import json
import sys
import time
import uuid
import wave
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO
from urllib.parse import quote

import httpx
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

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


def say_through(door: str, endpoint: str, text: str, voice: str, out: BinaryIO, response_format: str,
                seed: int | None, progress: BinaryIO | None = sys.stderr) -> SayResult:
    """say() through `door` (doors.DOORS): the OpenAI door in any of its formats, a socket door in pcm or wav."""
    if door == "openai":
        return say(endpoint, text, voice, out, response_format, seed, progress)
    if response_format not in ("pcm", "wav"):
        raise RuntimeError(f"the {door} door gives 24 kHz PCM: write pcm or wav, not {response_format}")
    started, first, audio_bytes = time.perf_counter(), None, 0
    sink = wave.open(out, "wb") if response_format == "wav" else None
    if sink is not None:
        sink.setnchannels(1), sink.setsampwidth(SAMPLE_BYTES), sink.setframerate(SAMPLE_RATE)
    for pcm in _until_closed(door, SOCKET_DOORS[door](endpoint.rstrip("/").replace("http", "ws", 1), text, voice)):
        if sink is not None:
            sink.writeframes(pcm)
        else:
            out.write(pcm)
        audio_bytes += len(pcm)
        first = first or time.perf_counter() - started
        if progress is not None:
            _progress(progress, first, audio_bytes, time.perf_counter() - started)
    if sink is not None:
        sink.close()  # the header's lengths, now known
    out.flush()
    result = SayResult(first or 0.0, audio_bytes / (SAMPLE_RATE * SAMPLE_BYTES), time.perf_counter() - started)
    if progress is not None:
        progress.write("\n")
    return result


def _send(ws, message: str) -> None:
    """Send, unless the server has closed: what it said before closing is still read (its error)."""
    try:
        ws.send(message)
    except ConnectionClosed:
        pass


def _until_closed(door: str, audio: Iterator[bytes]) -> Iterator[bytes]:
    """A door's audio; its socket closed before the audio ended is an error, with the server's reason."""
    try:
        yield from audio
    except ConnectionClosed as exc:
        reason = exc.rcvd.reason if exc.rcvd else str(exc)
        raise RuntimeError(f"the {door} door closed the socket before the audio ended: {reason}") from None


def _cartesia(ws_base: str, text: str, voice: str) -> Iterator[bytes]:
    with connect(f"{ws_base}/tts/websocket") as ws:
        _send(ws, json.dumps({"context_id": uuid.uuid4().hex, "transcript": text, "continue": False,
                              "model_id": "sonic-3", "voice": {"mode": "id", "id": voice},
                              "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": SAMPLE_RATE}}))
        for message in map(json.loads, ws):
            if message.get("type") == "chunk":
                yield base64.b64decode(message["data"])
            elif message.get("type") == "error":
                raise RuntimeError(f"cartesia door: {message.get('error')}")
            elif message.get("type") == "done":
                return


def _deepgram(ws_base: str, text: str, voice: str) -> Iterator[bytes]:
    with connect(f"{ws_base}/v1/speak?model={quote(voice)}&encoding=linear16&sample_rate={SAMPLE_RATE}") as ws:
        _send(ws, json.dumps({"type": "Speak", "text": text}))
        _send(ws, json.dumps({"type": "Flush"}))
        for message in ws:
            if isinstance(message, bytes):
                yield message
            elif (kind := json.loads(message).get("type")) == "Error":
                raise RuntimeError(f"deepgram door: {json.loads(message).get('description')}")
            elif kind == "Flushed":
                _send(ws, json.dumps({"type": "Close"}))
                return


def _elevenlabs(ws_base: str, text: str, voice: str) -> Iterator[bytes]:
    with connect(f"{ws_base}/v1/text-to-speech/{quote(voice)}/stream-input?output_format=pcm_{SAMPLE_RATE}") as ws:
        _send(ws, json.dumps({"text": text, "flush": True}))
        _send(ws, json.dumps({"text": ""}))
        for message in map(json.loads, ws):
            if message.get("error"):
                raise RuntimeError(f"elevenlabs door: {message.get('message')}")
            if message.get("audio"):
                yield base64.b64decode(message["audio"])
            if message.get("isFinal"):
                return


def _baseten(ws_base: str, text: str, voice: str) -> Iterator[bytes]:
    with connect(f"{ws_base}/environments/production/websocket") as ws:
        _send(ws, json.dumps({"voice": voice, "max_tokens": 2000, "buffer_size": 10}))
        _send(ws, text)
        _send(ws, "__END__")
        for message in ws:  # the server closes the socket after the last audio
            if isinstance(message, bytes):
                yield message
            else:
                raise RuntimeError(f"baseten door: {json.loads(message).get('message')}")


def _together(ws_base: str, text: str, voice: str) -> Iterator[bytes]:
    with connect(f"{ws_base}/v1/audio/speech/websocket?voice={quote(voice)}") as ws:
        _send(ws, json.dumps({"type": "input_text_buffer.append", "text": text}))
        _send(ws, json.dumps({"type": "input_text_buffer.commit"}))
        for event in map(json.loads, ws):
            if event["type"] in ("error", "conversation.item.tts.failed"):
                raise RuntimeError(f"together door: {event['error'].get('message')}")
            if event["type"] == "conversation.item.audio_output.delta":
                yield base64.b64decode(event["delta"])
            elif event["type"] == "conversation.item.audio_output.done":
                return


def _vllm_omni(ws_base: str, text: str, voice: str) -> Iterator[bytes]:
    with connect(f"{ws_base}/v1/audio/speech/stream") as ws:
        _send(ws, json.dumps({"type": "session.config", "voice": voice, "response_format": "pcm",
                              "stream_audio": True}))
        _send(ws, json.dumps({"type": "input.text", "text": text}))
        _send(ws, json.dumps({"type": "input.done"}))
        for message in ws:
            if isinstance(message, bytes):
                yield message
            elif (event := json.loads(message))["type"] == "error":
                raise RuntimeError(f"vllm-omni door: {event.get('message')}")
            elif event["type"] == "session.done":
                _send(ws, json.dumps({"type": "session.close"}))
                return


def _slng(ws_base: str, text: str, voice: str) -> Iterator[bytes]:
    with connect(f"{ws_base}/v1/bridges/unmute/tts/canopylabs/orpheus:en") as ws:
        _send(ws, json.dumps({"type": "init", "model": "canopylabs/orpheus:en", "voice": voice,
                              "config": {"encoding": "linear16", "sample_rate": SAMPLE_RATE}}))
        _send(ws, json.dumps({"type": "text", "text": text}))
        _send(ws, json.dumps({"type": "flush"}))
        for event in map(json.loads, ws):
            if event["type"] == "error":
                raise RuntimeError(f"slng door: {event.get('message')}")
            if event["type"] == "audio_chunk":
                yield base64.b64decode(event["data"])
            elif event["type"] == "flushed":
                _send(ws, json.dumps({"type": "close"}))
                return


SOCKET_DOORS = {"cartesia": _cartesia, "deepgram": _deepgram, "elevenlabs": _elevenlabs, "baseten": _baseten,
                "together": _together, "vllm-omni": _vllm_omni, "slng": _slng}


def say(endpoint: str, text: str, voice: str, out: BinaryIO, response_format: str, seed: int | None,
        progress: BinaryIO | None = sys.stderr) -> SayResult:
    """Stream speech for `text` into `out` through the OpenAI door, printing a progress line to `progress`."""
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

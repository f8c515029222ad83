"""The voice-agent frameworks' own TTS clients, unchanged, pointed at a running MegaPod by base URL.

Runs in .venv-clients (client_tests/requirements.txt), driven by tests/test_voice_agent_clients.py,
which starts `megapod up` and passes its addresses: MEGAPOD_URL (the front, what an agent is pointed
at), MEGAPOD_WORKER_METRICS and MEGAPOD_SNAC_METRICS (the workers' and codec replicas' /metrics). Each test checks the audio it received (a whole number of
2048-sample frames at 24 kHz, or the decoded length of an encoded format) and, for WebSockets,
that a cancel mid-stream frees the engine request and the codec stream.
"""

from __future__ import annotations

import asyncio
import os
import re
import time

import aiohttp
import httpx
import pytest

URL = os.environ.get("MEGAPOD_URL", "http://127.0.0.1:8000")
HOST = URL.split("://", 1)[1]
WORKER_METRICS = [u for u in os.environ.get("MEGAPOD_WORKER_METRICS", f"{URL}/metrics").split(",") if u]
SNAC_METRICS = [u for u in os.environ.get("MEGAPOD_SNAC_METRICS", "").split(",") if u]
FRAME = 2048
# Two short sentences, an agent's reply (two segments, each its own engine request): with random weights every
# segment speaks up to its token budget (its length in characters), so shorter is a shorter test.
TEXT = "Hello from the MegaPod. Bye."
LONG = " ".join(f"This is sentence number {i} of a long answer that the user will talk over." for i in range(12))
MP3_PRIMING = 1105 + 576  # LAME's delay and a frame of padding, in samples


def gauge(url: str, name: str, labels: str = "") -> float:
    """A metric's value from a /metrics page: summed over its label sets, or the one `labels` names."""
    text = httpx.get(url, timeout=10).text
    pattern = rf"^{re.escape(name + labels)} (\S+)$" if labels else rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$"
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def held() -> dict[str, float]:
    """What the worker and the codec replicas still hold."""
    out = {name: sum(gauge(u, name) for u in WORKER_METRICS)
           for name in ("orpheus_active_streams", "orpheus_engine_unfinished_requests")}
    out["snac_active_streams"] = sum(gauge(u, "snac_active_streams") for u in SNAC_METRICS)
    return out


async def nothing_held(within_s: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + within_s
    while any((readings := held()).values()) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return readings


def requests_ended(outcome: str) -> float:
    return sum(gauge(u, "orpheus_requests_total", f'{{outcome="{outcome}"}}') for u in WORKER_METRICS)


def whole_frames(samples: int) -> bool:
    return samples > 0 and samples % FRAME == 0


def tone_wav(seconds: float) -> bytes:
    """A reference recording: a 220 Hz tone, 24 kHz mono s16 WAV."""
    import io
    import wave

    import numpy as np

    t = np.arange(int(seconds * 24000)) / 24000
    tone = (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2")
    wav = io.BytesIO()
    with wave.open(wav, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(24000), w.writeframes(tone.tobytes())
    return wav.getvalue()


def listed_by_every_worker(voice: str) -> None:
    """Wait until every worker lists a voice one of them made (they share `megapod up`'s voices directory)."""
    for worker in (m.removesuffix("/metrics") for m in WORKER_METRICS):
        deadline = time.monotonic() + 30
        while voice not in [v["id"] for v in httpx.get(f"{worker}/v1/voices").json()["data"]]:
            assert time.monotonic() < deadline, f"{worker} never listed {voice}"
            time.sleep(0.2)


# ---------------------------------------------------------------------------------------- Pipecat

pipecat = pytest.importorskip("pipecat")
from pipecat.frames.frames import ErrorFrame, TTSAudioRawFrame, TTSSpeakFrame  # noqa: E402
from pipecat.pipeline.pipeline import Pipeline  # noqa: E402
from pipecat.processors.frame_processor import FrameProcessor  # noqa: E402
from pipecat.services.cartesia.tts import CartesiaTTSService  # noqa: E402
from pipecat.services.deepgram.tts import DeepgramTTSService  # noqa: E402
from pipecat.services.elevenlabs.tts import ElevenLabsHttpTTSService, ElevenLabsTTSService  # noqa: E402
from pipecat.services.openai.tts import OpenAITTSService  # noqa: E402
from pipecat.services.together.tts import TogetherTTSService  # noqa: E402
from pipecat.tests.utils import SleepFrame, run_test  # noqa: E402

PIPECAT = {
    "cartesia": lambda: CartesiaTTSService(api_key="unused", url=f"ws://{HOST}/tts/websocket",
                                           settings=CartesiaTTSService.Settings(voice="tara"), stop_frame_timeout_s=60.0),
    "deepgram": lambda: DeepgramTTSService(api_key="unused", base_url=f"ws://{HOST}",
                                           settings=DeepgramTTSService.Settings(voice="tara"), stop_frame_timeout_s=60.0),
    "openai": lambda: OpenAITTSService(api_key="unused", base_url=f"{URL}/v1",
                                       settings=OpenAITTSService.Settings(voice="alloy"), stop_frame_timeout_s=60.0),
    "elevenlabs": lambda: ElevenLabsTTSService(api_key="unused", url=f"ws://{HOST}",
                                               settings=ElevenLabsTTSService.Settings(voice="tara"), stop_frame_timeout_s=60.0),
    # The service's own example: Orpheus on Together, voice tara.
    "together": lambda: TogetherTTSService(api_key="unused", url=f"ws://{HOST}/v1/audio/speech/websocket",
                                           settings=TogetherTTSService.Settings(voice="tara",
                                                                                model="canopylabs/orpheus-3b-0.1-ft"),
                                           stop_frame_timeout_s=60.0),
}


@pytest.mark.parametrize("service", list(PIPECAT))
async def test_pipecat_service_speaks(service):
    down, up = await run_test(PIPECAT[service](), frames_to_send=[TTSSpeakFrame(text=TEXT), SleepFrame(sleep=1.0)])
    assert not [f for f in down + up if isinstance(f, ErrorFrame)]
    audio = [f for f in down if isinstance(f, TTSAudioRawFrame)]
    assert audio and all(f.sample_rate == 24000 and f.num_channels == 1 for f in audio)
    assert whole_frames(sum(len(f.audio) for f in audio) // 2)


async def test_pipecat_elevenlabs_http_service_speaks():
    async with aiohttp.ClientSession() as session:
        service = ElevenLabsHttpTTSService(api_key="unused", aiohttp_session=session, base_url=URL,
                                           settings=ElevenLabsHttpTTSService.Settings(voice="tara"))
        down, up = await run_test(service, frames_to_send=[TTSSpeakFrame(text=TEXT), SleepFrame(sleep=1.0)])
    assert not [f for f in down + up if isinstance(f, ErrorFrame)]
    audio = [f for f in down if isinstance(f, TTSAudioRawFrame)]
    assert audio and all(f.sample_rate == 24000 for f in audio)
    assert whole_frames(sum(len(f.audio) for f in audio) // 2)


@pytest.fixture(scope="module")
def clone_voice():
    """A clone voice made through the front (POST /v1/voices) from a generated WAV, listed by every worker (they
    share `megapod up`'s voices directory) before the tests use it; deleted after."""
    made = httpx.post(f"{URL}/v1/voices", data={"name": "agent-clone", "transcript": "A tone, one second long."},
                      files={"audio": ("reference.wav", tone_wav(1.0), "audio/wav")}, timeout=120)
    assert made.status_code == 201, made.text
    listed_by_every_worker("agent-clone")
    yield "agent-clone"
    assert httpx.delete(f"{URL}/v1/voices/agent-clone").status_code == 200


async def test_pipecat_cartesia_service_speaks_in_a_clone_voice(clone_voice):
    service = CartesiaTTSService(api_key="unused", url=f"ws://{HOST}/tts/websocket",
                                 settings=CartesiaTTSService.Settings(voice=clone_voice), stop_frame_timeout_s=60.0)
    down, up = await run_test(service, frames_to_send=[TTSSpeakFrame(text=TEXT), SleepFrame(sleep=1.0)])
    assert not [f for f in down + up if isinstance(f, ErrorFrame)]
    assert whole_frames(sum(len(f.audio) for f in down if isinstance(f, TTSAudioRawFrame)) // 2)


def until(done, first, within_s: float = 60.0):
    """`first`, then the test's pause until `done()` (at most `within_s`): run_test reads its frames one by
    one, sleeping at each SleepFrame, and ends the pipeline after the last. A fixed sleep here cost
    15 s a test, most of it after the event."""
    yield first
    for _ in range(int(within_s / 0.1)):
        if done():
            return
        yield SleepFrame(sleep=0.1)


class BargeIn(FrameProcessor):
    """The user, as a voice agent's VAD reports them: speaks over the bot at its first audio."""

    def __init__(self) -> None:
        super().__init__()
        self.heard = False

    async def process_frame(self, frame, direction):
        await super().process_frame(frame, direction)
        await self.push_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame) and not self.heard:
            self.heard = True
            await self.broadcast_interruption()  # reaches the TTS service upstream, as a real barge-in does


@pytest.mark.parametrize("service", ["cartesia", "deepgram", "elevenlabs", "together"])
async def test_pipecat_interruption_frees_the_engine_and_codec(service):
    before = requests_ended("cancelled")
    barge_in = BargeIn()
    frames = until(lambda: barge_in.heard and requests_ended("cancelled") > before, TTSSpeakFrame(text=LONG))
    await run_test(Pipeline([PIPECAT[service](), barge_in]), frames_to_send=frames)
    assert barge_in.heard, "audio was playing when the user spoke"
    assert await nothing_held() == {"orpheus_active_streams": 0, "orpheus_engine_unfinished_requests": 0,
                                    "snac_active_streams": 0}
    assert requests_ended("cancelled") > before, "the server saw the barge-in (cancel / Clear / close_context / clear)"


# ---------------------------------------------------------------------------------------- LiveKit

from livekit.plugins import baseten as lk_baseten  # noqa: E402
from livekit.plugins import cartesia as lk_cartesia  # noqa: E402
from livekit.plugins import deepgram as lk_deepgram  # noqa: E402
from livekit.plugins import elevenlabs as lk_elevenlabs  # noqa: E402
from livekit.plugins import openai as lk_openai  # noqa: E402
from livekit.plugins import slng as lk_slng  # noqa: E402


def livekit(name: str, session: aiohttp.ClientSession, **kw):
    if name == "cartesia":
        return lk_cartesia.TTS(api_key="unused", base_url=URL, voice="tara", http_session=session, **kw)
    if name == "deepgram":
        return lk_deepgram.TTS(api_key="unused", base_url=f"{URL}/v1/speak", model="tara", http_session=session, **kw)
    if name == "baseten":  # Baseten's Orpheus protocol: the socket, or `predict` for synthesize
        return lk_baseten.TTS(api_key="unused", model_endpoint=f"ws://{HOST}/environments/production/websocket",
                              voice="tara", http_session=session, **kw)
    if name == "qwen3":  # vLLM-Omni's speech socket, the plugin's qwen3-tts protocol: given by its full URL
        return lk_baseten.TTS(api_key="unused", model="qwen3-tts", model_endpoint=f"ws://{HOST}/v1/audio/speech/stream",
                              voice="tara", http_session=session, **kw)
    if name == "slng":  # SLNG's Unmute Bridge: the plugin builds ws://<host>/v1/bridges/unmute/tts/<model> locally
        return lk_slng.TTS(api_key="unused", model="canopylabs/orpheus:en", slng_base_url=HOST, voice="tara",
                           http_session=session, **kw)
    if name == "elevenlabs":
        return lk_elevenlabs.TTS(api_key="unused", base_url=f"{URL}/v1", voice_id="tara", http_session=session,
                                 **{"encoding": "pcm_24000", **kw})
    return lk_openai.TTS(api_key="unused", base_url=f"{URL}/v1", voice="alloy", **kw)


def samples_of(events) -> int:
    """Samples the server sent. LiveKit ends a segment with a marker of its own, a final 10 ms frame of
    zeros (livekit/agents/tts/tts.py, "a tiny empty marker"): not audio from the server."""
    return sum(ev.frame.samples_per_channel for ev in events if not _marker(ev))


def _marker(ev) -> bool:
    frame = ev.frame
    return ev.is_final and frame.samples_per_channel == frame.sample_rate // 100 and not any(bytes(frame.data))


async def stream_text(tts) -> list:
    """TEXT through the plugin's stream (its WebSocket): pushed, flushed and ended; the events it gave."""
    async with tts.stream() as stream:
        stream.push_text(TEXT)
        stream.flush()
        stream.end_input()
        return [ev async for ev in stream]


@pytest.mark.parametrize("name", ["cartesia", "deepgram", "elevenlabs", "qwen3", "slng"])
async def test_livekit_synthesize_and_stream(name):
    async with aiohttp.ClientSession() as session:
        tts = livekit(name, session)
        synthesized = [ev async for ev in tts.synthesize(TEXT)]  # HTTP: /tts/bytes, POST /v1/speak; or the socket
        streamed = await stream_text(tts)  # the WebSocket
        await tts.aclose()
    for events in (synthesized, streamed):
        assert events and all(ev.frame.sample_rate == 24000 and ev.frame.num_channels == 1 for ev in events)
        assert whole_frames(samples_of(events))


async def test_livekit_baseten_streams_over_its_socket_and_synthesizes_over_predict():
    """The plugin picks its transport by the endpoint's scheme: ws:// streams, http:// posts to predict."""
    async with aiohttp.ClientSession() as session:
        streaming = livekit("baseten", session)
        streamed = await stream_text(streaming)
        await streaming.aclose()
        http = lk_baseten.TTS(api_key="unused", model_endpoint=f"{URL}/environments/production/predict", voice="leo",
                              http_session=session)
        synthesized = [ev async for ev in http.synthesize(TEXT)]
        await http.aclose()
    for events in (streamed, synthesized):
        assert events and all(ev.frame.sample_rate == 24000 and ev.frame.num_channels == 1 for ev in events)
        assert whole_frames(samples_of(events))


async def test_livekit_deepgram_speaks_in_a_clone_voice(clone_voice):
    async with aiohttp.ClientSession() as session:
        tts = lk_deepgram.TTS(api_key="unused", base_url=f"{URL}/v1/speak", model=f"aura-2-{clone_voice}-en",
                              http_session=session)
        events = [ev async for ev in tts.synthesize(TEXT)]
        await tts.aclose()
    assert events and whole_frames(samples_of(events))


async def test_livekit_qwen3_registers_a_clone_over_the_socket_and_speaks_in_it(tmp_path):
    """The plugin's own register_voice (voice.add first on a socket of its own, the recording in base64: over the
    socket's usual 64 KiB) and list_voices, then qwen3-tts speaking in the clone; deleted after."""
    endpoint = f"ws://{HOST}/v1/audio/speech/stream"
    reference = tmp_path / "reference.wav"
    reference.write_bytes(tone_wav(2.0))
    voice = await lk_baseten.register_voice(model_endpoint=endpoint, name="omni-clone", ref_audio_path=str(reference),
                                            ref_text="A tone, two seconds long.", api_key="unused")
    try:
        assert voice["name"] == "omni-clone" and voice["kind"] == "clone"
        listed_by_every_worker("omni-clone")
        listed = await lk_baseten.list_voices(model_endpoint=endpoint, api_key="unused")
        assert "omni-clone" in listed["uploaded_voices"]
        async with aiohttp.ClientSession() as session:
            tts = lk_baseten.TTS(api_key="unused", model="qwen3-tts", model_endpoint=endpoint, voice="omni-clone",
                                 http_session=session)
            events = await stream_text(tts)
            await tts.aclose()
        assert events and whole_frames(samples_of(events))
    finally:
        assert httpx.delete(f"{URL}/v1/voices/omni-clone").status_code == 200


@pytest.mark.parametrize("model, response_format", [
    ("gpt-4o-mini-tts", "mp3"),  # the plugin's defaults: mp3 over server-sent events
    ("tts-1", "mp3"),  # a plain streamed body
    ("gpt-4o-mini-tts", "pcm"),
])
async def test_livekit_openai_in_its_default_mp3_and_its_sse_mode(model, response_format):
    tts = livekit("openai", None, model=model, response_format=response_format)
    async with tts.synthesize(TEXT) as stream:
        events = [ev async for ev in stream]
    await tts.aclose()
    samples = samples_of(events)
    assert events and all(ev.frame.sample_rate == 24000 for ev in events)
    if response_format == "pcm":
        assert whole_frames(samples)
    else:  # the decoded mp3: a whole number of frames plus the encoder's priming
        assert samples > 0 and (samples % FRAME <= MP3_PRIMING or samples % FRAME >= FRAME - 2), samples


async def test_livekit_elevenlabs_in_its_default_mp3():
    """The plugin's default encoding, mp3_22050_32, over HTTP and the WebSocket."""
    async with aiohttp.ClientSession() as session:
        tts = lk_elevenlabs.TTS(api_key="unused", base_url=f"{URL}/v1", voice_id="tara", http_session=session)
        synthesized = [ev async for ev in tts.synthesize(TEXT)]
        async with tts.stream() as stream:
            stream.push_text(TEXT)
            stream.end_input()
            streamed = [ev async for ev in stream]
        await tts.aclose()
    for events in (synthesized, streamed):
        assert events and all(ev.frame.sample_rate == 22050 for ev in events) and samples_of(events) > 0


@pytest.mark.parametrize("name", ["cartesia", "deepgram", "elevenlabs", "baseten", "qwen3", "slng"])
async def test_livekit_stream_closed_mid_speech_frees_the_engine_and_codec(name):
    before = requests_ended("disconnected") + requests_ended("cancelled")
    async with aiohttp.ClientSession() as session:
        tts = livekit(name, session)
        stream = tts.stream()
        stream.push_text(LONG)
        stream.flush()
        heard = False
        async for _ in stream:  # the first audio: the answer is being spoken
            heard = True
            break
        await stream.aclose()  # the agent stops speaking (LiveKit sends no cancel; it drops the socket)
        await tts.aclose()
    assert heard, "audio was playing when the agent stopped"
    assert await nothing_held() == {"orpheus_active_streams": 0, "orpheus_engine_unfinished_requests": 0,
                                    "snac_active_streams": 0}
    # LiveKit's Deepgram client sends Close as it goes (counted cancelled); its Cartesia client just drops the socket.
    assert requests_ended("disconnected") + requests_ended("cancelled") > before, "the server ended the stream early"


# ---------------------------------------------------------------------------------------- the official SDKs over TLS
# MEGAPOD_TLS_URL: a front over TLS on the same workers (tests/test_voice_agent_clients.py), its private CA trusted
# through SSL_CERT_FILE as a user's would be: the SDKs are given nothing but the base URL.
TLS_URL = os.environ.get("MEGAPOD_TLS_URL", "")
over_tls = pytest.mark.skipif(not TLS_URL, reason="no front over TLS given (MEGAPOD_TLS_URL)")


@over_tls
def test_elevenlabs_sdk_speaks_over_wss_in_realtime_and_over_https():
    """The SDK's convert_realtime builds its socket's URL from the base URL with the scheme replaced by wss (the
    reason for TLS at the front); text_to_speech.stream is its HTTP path."""
    from elevenlabs.client import ElevenLabs

    client = ElevenLabs(api_key="unused", base_url=TLS_URL)
    before = requests_ended("ok")
    realtime = b"".join(client.text_to_speech.convert_realtime(
        voice_id="tara", text=iter(["Hello from ", "the MegaPod. ", "Bye."]), model_id="eleven_flash_v2_5",
        output_format="pcm_24000"))
    streamed = b"".join(client.text_to_speech.stream(voice_id="tara", text=TEXT, model_id="eleven_flash_v2_5",
                                                     output_format="pcm_24000"))
    for audio in (realtime, streamed):
        assert whole_frames(len(audio) // 2), len(audio)
    assert requests_ended("ok") >= before + 2  # the socket's and the HTTP request's, through the TLS front


@over_tls
def test_openai_sdk_speaks_over_https():
    import openai

    client = openai.OpenAI(base_url=f"{TLS_URL}/v1", api_key="unused")
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input=TEXT,
                                                            response_format="pcm") as response:
        audio = b"".join(response.iter_bytes())
    assert whole_frames(len(audio) // 2), len(audio)

"""The Baseten-compatible door (llm_server/doors/baseten.py, issue 27): the metadata message, text frames and __END__ that
LiveKit's baseten.TTS sends, raw PCM back and the close; a client closing the socket is a barge-in; hostile
input gets the protocol's error and close with nothing held; the HTTP predict route; keys as Api-Key."""

from __future__ import annotations

import json

import httpx
import pytest
from served import FRAME_BYTES, NOTHING_HELD, CharTokenizerDouble, ScriptedEngineDouble, baseline, serving, settled, ws_url
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from llm_server.speech.prompt import prompt_ids

FRAMES = 4  # the engine double's frames per sentence
PATH = "/environments/production/websocket"
METADATA = json.dumps({"voice": "leo", "max_tokens": 2000, "buffer_size": 10})


async def received(ws) -> tuple[bytes, list[str], int]:
    """Everything the server sends until it closes: the audio, its text frames, the close code."""
    audio, texts = b"", []
    try:
        async for message in ws:
            if isinstance(message, bytes):
                audio += message
            else:
                texts.append(message)
    except ConnectionClosed:
        pass
    return audio, texts, ws.close_code


async def test_text_pieces_then_end_are_spoken_as_sentences_and_the_server_closes_after_the_audio(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES)) as served:
        quiet = await baseline(served, snac_server)
        async with connect(ws_url(served, PATH)) as ws:
            await ws.send(METADATA)
            for piece in ("Hello ", "there. How", " are you", "?", "__END__"):  # as an agent's LLM writes it
                await ws.send(piece)
            audio, texts, code = await received(ws)
        assert (len(audio), texts, code) == (2 * FRAMES * FRAME_BYTES, [], 1000)  # two sentences, nothing else
        prompts = sorted(p for p in served.engine.prompts.values() if p != prompt_ids(CharTokenizerDouble(), "tara", "Hello there."))
        assert prompts == sorted(prompt_ids(CharTokenizerDouble(), "leo", t) for t in ("Hello there.", "How are you?"))
        assert await settled(served, snac_server, quiet) == NOTHING_HELD


async def test_closing_the_socket_mid_speech_is_a_barge_in_that_frees_everything(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=400, batch_delay_s=0.01)) as served:
        quiet = await baseline(served, snac_server)
        async with connect(ws_url(served, PATH)) as ws:
            await ws.send(METADATA)
            await ws.send("A long answer the user talks over. ")
            assert isinstance(await ws.recv(), bytes)
        assert await settled(served, snac_server, quiet) == NOTHING_HELD


@pytest.mark.parametrize("messages, code, said", [
    (["{not json"], 1008, "first message must be the JSON metadata"),
    (["[1, 2]"], 1008, "a message must be a JSON object"),
    ([json.dumps({"voice": "thalia"})], 1008, "unknown voice 'thalia'"),
    ([json.dumps({"voice": 7})], 1008, "voice must be a string"),
    ([json.dumps({"type": "session.config", "voice": "tara"})], 1008, "its socket is /v1/audio/speech/stream"),
    ([b"\x00\x01"], 1003, "not a binary frame"),
    ([METADATA, "Hi. ", b"\x00"], 1003, "binary frames are not part of this protocol"),
    ([METADATA, "x" * 4000, "y" * 200], 1008, "over 4096 characters of text"),
], ids=["not-json", "not-object", "unknown-voice", "voice-not-string", "qwen3-config", "binary-metadata", "binary-text",
        "too-long"])
async def test_hostile_input_gets_an_error_frame_and_a_close_with_nothing_held(snac_server, messages, code, said):
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES)) as served:
        quiet = await baseline(served, snac_server)
        async with connect(ws_url(served, PATH)) as ws:
            for message in messages:
                await ws.send(message)
            _, texts, close_code = await received(ws)
        assert close_code == code and said in json.loads(texts[-1])["message"]
        assert json.loads(texts[-1])["type"] == "error"
        assert await settled(served, snac_server, quiet) == NOTHING_HELD


async def test_a_client_gone_before_end_frees_everything(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES)) as served:
        quiet = await baseline(served, snac_server)
        async with connect(ws_url(served, PATH)) as ws:
            await ws.send(METADATA)
            await ws.send("Half a sentence and then nothing")
        assert await settled(served, snac_server, quiet) == NOTHING_HELD


async def test_the_predict_route_streams_raw_pcm_and_refuses_what_it_cannot_speak(snac_server):
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES)) as served, \
            httpx.AsyncClient(base_url=served.url, timeout=60) as client:
        spoken = await client.post("/environments/production/predict",
                                   json={"prompt": "Hi there.", "voice": "leo", "temperature": 0.6, "language": "en"})
        assert spoken.status_code == 200 and len(spoken.content) == FRAMES * FRAME_BYTES
        for body, said in (({"prompt": "Hi.", "voice": "thalia"}, "unknown voice"), ({"voice": "leo"}, "prompt")):
            refused = await client.post("/environments/production/predict", json=body)
            assert refused.status_code == 400 and said in refused.json()["error"]["message"]


async def test_keys_are_taken_as_the_plugin_sends_them(snac_server, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("agent:baseten-key-001\n")
    async with serving(snac_server, ScriptedEngineDouble(frames=FRAMES), api_keys_file=str(keys)) as served:
        async with connect(ws_url(served, PATH), additional_headers={"Authorization": "Api-Key baseten-key-001"}) as ws:
            await ws.send(METADATA)
            await ws.send("Hi.")
            await ws.send("__END__")
            audio, _, code = await received(ws)
        assert len(audio) == FRAMES * FRAME_BYTES and code == 1000
        with pytest.raises(InvalidStatus, match="403"):
            async with connect(ws_url(served, PATH), additional_headers={"Authorization": "Api-Key wrong-key-0001"}):
                pass

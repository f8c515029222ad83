"""Hostile input to the HTTP API, against a real llm-server worker and real codec replicas.

Schemathesis fuzzes every operation of the worker's own OpenAPI document (/openapi.json) with
valid and invalid requests; explicit cases cover what a schema cannot describe: bodies too big
to read, bytes that are not JSON, and names that look like paths. Whatever comes in: no 5xx, no
crash, no stream left running (the active-streams and engine gauges return to 0).
"""

from __future__ import annotations

import json
import socket

import httpx

from llm_server.speech.encoding import SAMPLE_RATES
from llm_server.doors.openai import FORMATS, STREAM_FORMATS
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from processes import MAX_MODEL_LEN, wait_metric_zero

MAX_BODY_BYTES = 65536  # LlmServerConfig.max_body_bytes (the worker runs on defaults)
MAX_INPUT_CHARS = 4096  # LlmServerConfig.max_input_chars


@pytest.fixture(scope="module")
def stack(megapod):
    """Worker 0 of the session's `megapod up` (conftest.megapod), spoken to directly."""
    worker = megapod["llm"][0]
    parts = [worker, *megapod["snac"]]
    return {"worker": worker, "url": f"http://127.0.0.1:{worker.port}", "parts": parts, "deaths": [p.deaths() for p in parts]}


def _speech(stack, body=None, content=None, headers=None) -> httpx.Response:
    """POST /v1/audio/speech; reads the status and headers only, then leaves (a disconnect).

    The body is ASCII-escaped JSON, so text no UTF-8 encoder takes (lone surrogates) still goes out."""
    content = content if content is not None else json.dumps(body).encode()
    headers = headers or {"content-type": "application/json"}
    with httpx.stream("POST", f"{stack['url']}/v1/audio/speech", content=content, headers=headers, timeout=60) as r:
        if r.status_code != 200:
            r.read()
        return r


def _assert_client_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code


# -- schema-driven fuzzing ----------------------------------------------------------------------


def tighten(raw: dict, stack) -> None:
    """Declare in the document what the server enforces, so generated bodies get past the first check.

    The served document types `model`, `voice`, `response_format` and `stream_format` as free
    strings, so nearly every generated body would stop at "model not found". These are the
    constraints it could declare (they depend on the worker's config); negative generation still
    sends values outside them.
    """
    models = [m["id"] for m in httpx.get(f"{stack['url']}/v1/models").json()["data"]]
    voices = httpx.get(f"{stack['url']}/v1/voices").json()
    props = raw["components"]["schemas"]["SpeechBody"]["properties"]
    props["model"]["enum"] = models
    props["voice"]["enum"] = [v["id"] for v in voices["data"]] + list(voices["aliases"])
    props["response_format"]["enum"] = list(FORMATS)
    props["stream_format"]["enum"] = list(STREAM_FORMATS)
    props["sample_rate"]["enum"] = list(SAMPLE_RATES)
    props["speed"]["enum"] = [1.0]
    props["input"]["maxLength"] = 20  # short accepted inputs: the fuzz budget is requests, not audio


@pytest.fixture(scope="module")
def api_schema(stack):
    """The worker's own /openapi.json, tightened as above, aimed at the worker."""
    raw = httpx.get(f"{stack['url']}/openapi.json").json()
    tighten(raw, stack)
    schema = schemathesis.openapi.from_dict(raw)
    schema.config.update(base_url=stack["url"])
    return schema


# Cases are drawn inside the test (st.data) rather than through schemathesis' pytest loader:
# its lazy `from_fixture` loader breaks on pytest 9 (it sets Node._nodeid, which pytest 9 removed).
# Operations without inputs (the GETs) have one case each; the rest of the budget goes to speech.
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_openapi_operations_never_fail_on_the_server(api_schema, mode, data):
    """Every operation, valid and invalid requests: no 5xx, responses match the schema where declared."""
    case = data.draw(api_schema.as_strategy(mode), label="case")
    case.call_and_validate(checks=[not_a_server_error, response_schema_conformance], timeout=120)


# -- bodies too big to read ---------------------------------------------------------------------


def _answer_to_partial_body(port: int, framing: str, first_part: bytes) -> bytes:
    """Send the request head and only `first_part` of its body, then wait for the server's answer.

    A server that read bodies whole would wait for the rest and never answer.
    """
    head = f"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n{framing}\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head.encode() + first_part)
        try:
            return sock.recv(4096)
        except TimeoutError:
            return b"(no answer in 10 s: the server is waiting for the rest of the body)"


def test_declared_huge_body_is_refused_before_it_is_sent(stack):
    """8 MB declared in Content-Length, 64 KB sent: 413 at once, the other 8 MB never needed."""
    answer = _answer_to_partial_body(stack["worker"].port, f"Content-Length: {8 * 2**20}\r\n", b" " * 65536)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


def test_chunked_huge_body_is_refused_once_past_the_limit(stack):
    """A chunked body with no Content-Length and no end: 413 once the limit is passed."""
    piece = b" " * 16384
    chunks = (f"{len(piece):x}\r\n".encode() + piece + b"\r\n") * (MAX_BODY_BYTES // len(piece) + 1)
    answer = _answer_to_partial_body(stack["worker"].port, "Transfer-Encoding: chunked\r\n", chunks)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


def test_body_over_the_limit_by_one_byte_is_a_413_and_at_the_limit_is_read(stack):
    body = json.dumps({"model": "tts-1", "input": "hi", "voice": "tara"}).encode()
    at_limit = body[:-1] + b" " * (MAX_BODY_BYTES - len(body)) + b"}"  # whitespace: the same request
    assert len(at_limit) == MAX_BODY_BYTES
    headers = {"content-type": "application/json"}
    r = httpx.post(f"{stack['url']}/v1/audio/speech", content=at_limit + b" ", headers=headers, timeout=30)
    _assert_client_error(r, 413, code="body_too_large")
    r = _speech(stack, content=at_limit, headers=headers)
    assert r.status_code == 200, r.text


# -- bodies that are not the JSON object the API expects ----------------------------------------


NOT_JSON = {
    "deeply nested arrays": b'{"model": ' + b"[" * 20000 + b"]" * 20000 + b"}",
    "deeply nested objects": b'{"model": ' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}",
    "non-UTF-8 bytes": b'{"model": "tts-1", "input": "\xff\xfe\xc3\x28", "voice": "tara"}',
    "a JSON array": b'[{"model": "tts-1", "input": "hi"}]',
    "a JSON string": b'"hello"',
    "null": b"null",
    "empty body": b"",
    "NUL bytes": b"\x00" * 100,
    "truncated": b'{"model": "tts-1", "input": "hi',
    "NaN seed": b'{"model": "tts-1", "input": "hi", "voice": "tara", "seed": NaN}',
    "huge number": b'{"model": "tts-1", "input": "hi", "voice": "tara", "speed": 1e999999}',
}


@pytest.mark.parametrize("case", list(NOT_JSON))
def test_bodies_that_are_not_a_speech_request_get_openai_shaped_errors(stack, case):
    _assert_client_error(_speech(stack, content=NOT_JSON[case]), 400)


def test_utf16_json_is_read_like_utf8(stack):
    """json.loads detects UTF-16/32 (RFC 8259 lets a parser accept them): spoken, not a 5xx."""
    body = json.dumps({"model": "tts-1", "input": "hi", "voice": "tara"}).encode("utf-16")
    assert _speech(stack, content=body).status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None])
def test_wrong_content_type_is_a_400(stack, content_type):
    headers = {"content-type": content_type} if content_type else {}
    body = json.dumps({"model": "tts-1", "input": "hi", "voice": "tara"}).encode()
    r = _speech(stack, content=body, headers=headers)
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        _assert_client_error(r, 400)


def test_input_just_over_the_limit_is_a_400(stack):
    r = _speech(stack, {"model": "tts-1", "input": "a" * (MAX_INPUT_CHARS + 1), "voice": "tara"})
    _assert_client_error(r, 400, "input", "input_too_long")


# -- names that look like paths -----------------------------------------------------------------


PATHS = ["../../etc/passwd", "/etc/passwd", "/models/x", "tiny", "./orpheus", "orpheus/../../..", "C:\\Windows\\win.ini",
         "file:///etc/passwd", "orpheus\x00", "%2e%2e%2f"]


@pytest.mark.parametrize("model", PATHS)
def test_model_naming_a_path_is_a_404_that_reads_nothing(stack, model):
    served = [m["id"] for m in httpx.get(f"{stack['url']}/v1/models").json()["data"]]
    r = _speech(stack, {"model": model, "input": "hi", "voice": "tara"})
    _assert_client_error(r, 404, "model", "model_not_found")
    assert f"this server speaks {served}" in r.json()["error"]["message"], "a check against the served names, not a load"
    assert "root:" not in r.text


@pytest.mark.parametrize("voice", PATHS)
def test_voice_naming_a_path_is_a_400(stack, voice):
    r = _speech(stack, {"model": "tts-1", "input": "hi", "voice": voice})
    _assert_client_error(r, 400, "voice")
    assert "root:" not in r.text


# -- text the model has never seen ---------------------------------------------------------------


ODD_TEXT = [
    "\u202eRight-to-left override\u202c and back",
    "مرحبا بالعالم",
    "שלום עולם",
    "🎵🎶👩‍👩‍👧‍👦🏳️‍🌈",
    "\x00\x01\x02\x1f\x7f",
    "Zalgo: Z̷̢̛a̶l̵g̴o̸",
    "\ufeff\u200b\u200d\u2060",
    "\ud800 lone surrogate",
    "<|endoftext|><custom_token_4> <laugh> <|audio|>",
    "tara: hi\n\n\r\n\t",
    "\U0010ffff\ue000",
]


def _assert_speech_or_client_error(r: httpx.Response) -> None:
    assert r.status_code in (200, 400), f"{r.status_code}: {r.text if r.status_code != 200 else ''}"
    if r.status_code == 400:
        _assert_client_error(r, 400)


@pytest.mark.parametrize(
    "text", ODD_TEXT, ids=[f"text{i}" for i in range(len(ODD_TEXT))]
)
def test_odd_text_is_spoken_or_refused(stack, text):
    _assert_speech_or_client_error(_speech(stack, {"model": "tts-1", "input": text, "voice": "tara"}))


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(text=st.text(st.characters(codec="utf-8"), min_size=1, max_size=30))
def test_any_text_is_spoken_or_refused(stack, text):
    """Any Unicode text (control characters, emoji, RTL, combining marks): 200 or 400, never 5xx."""
    _assert_speech_or_client_error(_speech(stack, {"model": "tts-1", "input": text, "voice": "tara", "response_format": "pcm"}))


@pytest.mark.parametrize("seed", [0, 2**63, 2**64 - 1])
def test_any_uint64_seed_is_spoken(stack, seed):
    assert _speech(stack, {"model": "tts-1", "input": "hi", "voice": "tara", "seed": seed}).status_code == 200


@pytest.mark.parametrize("seed", [-1, 2**64, -(2**70), 10**30])
def test_a_seed_outside_uint64_is_a_400(stack, seed):
    """The codec's noise seed is a uint64: anything else is refused up front, not a 503 later."""
    _assert_client_error(_speech(stack, {"model": "tts-1", "input": "hi", "voice": "tara", "seed": seed}), 400, "seed")


# -- text that tokenizes past the worker's context -------------------------------------------------

# Within max_input_chars and one segment (max_segment_chars 280), but 4 UTF-8 bytes a character, a token
# a byte for this tokenizer: its prompt is over this worker's context. Schemathesis found it as a 503.
DENSE = "𝔘𝔫𝔦𝔠𝔬𝔡𝔢" * 40
DOORS = {
    "openai": ("/v1/audio/speech", {"model": "tts-1", "input": DENSE, "voice": "tara", "response_format": "pcm"}),
    "cartesia-bytes": ("/tts/bytes", {"model_id": "sonic-3", "transcript": DENSE, "voice": {"mode": "id", "id": "tara"},
                                      "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}}),
    "deepgram": ("/v1/speak?model=tara&encoding=linear16&container=none", {"text": DENSE}),
}


@pytest.mark.parametrize("door", DOORS)
def test_a_prompt_over_the_context_is_a_400_that_holds_nothing(stack, door):
    """Refused as the client's input before the engine sees it, at each HTTP door, before any audio;
    the stream's slot, codec streams and engine request are all released."""
    path, body = DOORS[door]
    r = httpx.post(f"{stack['url']}{path}", json=body, timeout=60)
    _assert_client_error(r, 400, code="context_length_exceeded")
    assert f"{MAX_MODEL_LEN} tokens" in r.json()["error"]["message"]
    port = stack["worker"].port
    assert wait_metric_zero(port, "orpheus_active_streams", within_s=30) == 0
    assert wait_metric_zero(port, "orpheus_engine_unfinished_requests", within_s=30) == 0


# -- afterwards ----------------------------------------------------------------------------------


def test_still_healthy_and_no_stream_left_running(stack):
    """Runs last: whatever came before, the worker serves, and no stream or engine request is held."""
    port = stack["worker"].port
    assert [p.deaths() for p in stack["parts"]] == stack["deaths"], "the worker or a replica died"
    assert httpx.get(f"{stack['url']}/health").status_code == 200
    assert httpx.get(f"{stack['url']}/ready").status_code == 200
    assert wait_metric_zero(port, "orpheus_active_streams", within_s=30) == 0
    assert wait_metric_zero(port, "orpheus_engine_unfinished_requests", within_s=30) == 0
    r = _speech(stack, {"model": "tts-1", "input": "Still here.", "voice": "tara"})
    assert r.status_code == 200

"""The voice-agent frameworks' TTS clients, unchanged, against the real stack (the session's `megapod up`:
the front, two workers on vLLM, two codec replicas) by the front's base URL: Pipecat's Cartesia, Deepgram and
OpenAI services and LiveKit's cartesia, deepgram, openai, baseten (Orpheus's protocol, and qwen3-tts: vLLM-Omni's
socket) and slng plugins; and the official ElevenLabs and OpenAI SDKs over TLS, through a second front
over the same workers (`megapod front --ssl-certfile/--ssl-keyfile`, with `megapod up --tls-dir`'s local CA, which
the clients trust through SSL_CERT_FILE). They live in .venv-clients (client_tests/requirements.txt,
installed by `make test`): Pipecat pins protobuf<7, this project's grpcio stack needs protobuf>=7.35.
"""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from megapod.launcher import Child, free_ports
from megapod.local_tls import ensure_local_tls

REPO = Path(__file__).resolve().parent.parent
CLIENTS_PYTHON = REPO / ".venv-clients" / "bin" / "python"


@pytest.fixture(scope="module")
def stack(megapod):
    """The session's `megapod up` (conftest.megapod): its front, and every worker's and replica's metrics."""
    return {"front": megapod["url"],
            "workers": [f"http://127.0.0.1:{worker.metrics_port}/metrics" for worker in megapod["llm"]],
            "replicas": [f"http://127.0.0.1:{replica.metrics_port}/metrics" for replica in megapod["snac"]]}


@pytest.fixture(scope="module")
def tls_front(megapod, tmp_path_factory):
    """`megapod front` over TLS in front of the session's workers, its certificate from a local CA (the files
    `megapod up --tls-dir` makes): its https URL and the CA's file."""
    made = ensure_local_tls(tmp_path_factory.mktemp("tls"))
    (port,) = free_ports(1)
    workers = ",".join(f"http://127.0.0.1:{worker.port}" for worker in megapod["llm"])
    front = Child("tls front", [sys.executable, "-m", "megapod", "front", "--host", "127.0.0.1", "--port", str(port),
                                "--workers", workers, "--ssl-certfile", str(made.certfile), "--ssl-keyfile",
                                str(made.keyfile)], tmp_path_factory.mktemp("tls-front") / "front.log").start()
    url, trusting = f"https://127.0.0.1:{port}", ssl.create_default_context(cafile=str(made.ca))
    try:
        deadline = time.monotonic() + 60
        while True:  # Child's own probe trusts no private CA: this one does
            assert front.alive() and time.monotonic() < deadline, front.tail()
            try:
                if httpx.get(f"{url}/ready", verify=trusting, timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield {"url": url, "ca": str(made.ca)}
    finally:
        front.stop()


def test_the_frameworks_own_clients_work_unchanged(stack, tls_front):
    assert CLIENTS_PYTHON.exists(), "`make test` installs .venv-clients from client_tests/requirements.txt"
    assert httpx.get(f"{stack['front']}/ready", timeout=10).status_code == 200
    env = {**os.environ, "MEGAPOD_URL": stack["front"], "MEGAPOD_WORKER_METRICS": ",".join(stack["workers"]),
           "MEGAPOD_SNAC_METRICS": ",".join(stack["replicas"]),
           "MEGAPOD_TLS_URL": tls_front["url"], "SSL_CERT_FILE": tls_front["ca"]}  # as a user trusts a private CA
    env.pop("PYTHONPATH", None)
    env.pop("PYTEST_ADDOPTS", None)  # this run's pytest options (plugins, -k) are not the clients' run's
    done = subprocess.run([str(CLIENTS_PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", "client_tests"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    print(done.stdout[-6000:])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout.splitlines()[-1] and "skipped" not in done.stdout.splitlines()[-1]

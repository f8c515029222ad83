"""The voice-agent frameworks' TTS clients, unchanged, against the real stack (the session's `megapod up`:
the front, two workers on vLLM, two codec replicas) by the front's base URL: Pipecat's Cartesia, Deepgram and OpenAI services and LiveKit's
cartesia, deepgram and openai plugins. They live in .venv-clients (client_tests/requirements.txt,
installed by `make test`): Pipecat pins protobuf<7, this project's grpcio stack needs protobuf>=7.35.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
CLIENTS_PYTHON = REPO / ".venv-clients" / "bin" / "python"


@pytest.fixture(scope="module")
def stack(megapod):
    """The session's `megapod up` (conftest.megapod): its front, and every worker's and replica's metrics."""
    return {"front": megapod["url"],
            "workers": [f"http://127.0.0.1:{worker.metrics_port}/metrics" for worker in megapod["llm"]],
            "replicas": [f"http://127.0.0.1:{replica.metrics_port}/metrics" for replica in megapod["snac"]]}


def test_the_frameworks_own_clients_work_unchanged(stack):
    assert CLIENTS_PYTHON.exists(), "`make test` installs .venv-clients from client_tests/requirements.txt"
    assert httpx.get(f"{stack['front']}/ready", timeout=10).status_code == 200
    env = {**os.environ, "MEGAPOD_URL": stack["front"], "MEGAPOD_WORKER_METRICS": ",".join(stack["workers"]),
           "MEGAPOD_SNAC_METRICS": ",".join(stack["replicas"])}
    env.pop("PYTHONPATH", None)
    env.pop("PYTEST_ADDOPTS", None)  # this run's pytest options (plugins, -k) are not the clients' run's
    done = subprocess.run([str(CLIENTS_PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", "client_tests"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    print(done.stdout[-6000:])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout.splitlines()[-1] and "skipped" not in done.stdout.splitlines()[-1]

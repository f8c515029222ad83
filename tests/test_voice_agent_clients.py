"""The voice-agent frameworks' TTS clients, unchanged, against the real stack (`megapod up`: the front,
a worker on vLLM, two codec replicas) by the front's base URL: Pipecat's Cartesia, Deepgram and OpenAI services and LiveKit's
cartesia, deepgram and openai plugins. They live in .venv-clients (client_tests/requirements.txt,
installed by `make test`): Pipecat pins protobuf<7, this project's grpcio stack needs protobuf>=7.35.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from megapod.topology import MegaPodConfig
from processes import free_block

REPO = Path(__file__).resolve().parent.parent
CLIENTS_PYTHON = REPO / ".venv-clients" / "bin" / "python"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """`megapod up` on free ports, as a user runs it."""
    logs = tmp_path_factory.mktemp("client-stack")
    base = free_block(6)  # front, worker, two codec replicas and their metrics ports
    ports = [base, base + 1, base + 2, base + 4]
    config = MegaPodConfig(workers=1, replicas=2, front_port=ports[0], worker_base_port=ports[1],
                           snac_base_port=ports[2], snac_metrics_base_port=ports[3])
    flags = ["--workers", "1", "--replicas", "2", "--front-port", str(ports[0]), "--worker-base-port", str(ports[1]),
             "--snac-base-port", str(ports[2]), "--snac-metrics-base-port", str(ports[3]), "--llm-device", "cpu",
             "--snac-device", "cpu", "--enforce-eager", "true", "--max-model-len", "1024"]
    log = (logs / "up.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "megapod", "up", *flags], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "MEGAPOD_LOG_DIR": str(logs)})
    try:
        deadline = time.monotonic() + 420
        while "MegaPod ready" not in (logs / "up.log").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, (logs / "up.log").read_text()[-3000:]
            time.sleep(1)
        yield {"front": f"http://127.0.0.1:{ports[0]}",
               "workers": [f"http://127.0.0.1:{p}/metrics" for p in config.worker_ports()],
               "replicas": [f"http://127.0.0.1:{config.snac_metrics_base_port + j}/metrics" for j in range(config.replicas)]}
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


def test_the_frameworks_own_clients_work_unchanged(stack):
    assert CLIENTS_PYTHON.exists(), "`make test` installs .venv-clients from client_tests/requirements.txt"
    assert httpx.get(f"{stack['front']}/ready", timeout=10).status_code == 200
    env = {**os.environ, "MEGAPOD_URL": stack["front"], "MEGAPOD_WORKER_METRICS": ",".join(stack["workers"]),
           "MEGAPOD_SNAC_METRICS": ",".join(stack["replicas"])}
    env.pop("PYTHONPATH", None)
    done = subprocess.run([str(CLIENTS_PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", "client_tests"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    print(done.stdout[-6000:])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout.splitlines()[-1] and "skipped" not in done.stdout.splitlines()[-1]

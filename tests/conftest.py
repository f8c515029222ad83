"""Shared fixtures: a real SNAC server on a loopback port, and the decoder it serves; the session's
`megapod up`."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
from hypothesis import settings


from codec_contract.api import codec_pb2_grpc
from codec_contract.client import channel
from snac_server.config import SnacServerConfig
from snac_server.server import build_server


# Hypothesis fails an example that runs over 200 ms by default: a wall-clock bound, which a loaded
# 2-core machine can cross (test_prompt's property tests ran with it; the others set deadline=None).
settings.register_profile("no-deadline", deadline=None)
settings.load_profile("no-deadline")


def random_frames(n: int, seed: int) -> np.ndarray:
    """n frames of valid codes, with code 0 present so the edge of the range is exercised."""
    frames = np.random.default_rng(seed).integers(0, 4096, size=(n, 7))
    if n:
        frames[0, 0] = 0
    return frames


def server_config(**overrides) -> SnacServerConfig:
    """Loopback, ephemeral ports, CPU, random weights: a config every test machine can run."""
    values = dict(host="127.0.0.1", port=0, metrics_port=0, device="cpu", model="random-24khz", max_wait_ms=20.0)
    values.update(overrides)
    return SnacServerConfig(**values)


@pytest_asyncio.fixture(scope="module")
async def snac_server():
    """One real grpc.aio codec server per test module (model load and warm-up take seconds)."""
    server, port = build_server(server_config())
    await server.start()
    server.address = f"127.0.0.1:{port}"
    yield server
    await server.stop(grace_s=1.0)


@pytest_asyncio.fixture(scope="module")
async def stub(snac_server):
    """A client stub over a real loopback channel."""
    async with channel(snac_server.address) as ch:
        yield codec_pb2_grpc.SnacCodecStub(ch)


@pytest.fixture
def image_build(request: pytest.FixtureRequest) -> tuple[subprocess.Popen, Path]:
    """The background build phase pytest_collection_finish started, and its folder."""
    return request.config.stash[IMAGE_BUILD]


@pytest.fixture(scope="session")
def megapod(tmp_path_factory):
    """`megapod up` with 2 workers (8 streams each) and 2 codec replicas, as a user runs it: started once
    for every test that drives the whole stack (vLLM's start is most of a minute on two cores)."""
    from processes import megapod_up

    with megapod_up(tmp_path_factory.mktemp("megapod-logs"), workers=2, replicas=2, max_streams=8) as up:
        yield up


@pytest.fixture(scope="session")
def worker_stack(tmp_path_factory):
    """One LLM worker (real vLLM on the CPU, the tiny model) over two codec replicas, as processes on
    loopback: started once for every test that drives a worker directly (test_http_fuzz, test_llm_server,
    test_overload, test_worker_drain). It admits WORKER_MAX_STREAMS streams (a fixed limit), has a 1024-token context and
    drains for up to 120 s on SIGTERM, the union of what those tests need; test_worker_drain ends it, so it
    runs last."""
    from processes import WORKER_MAX_STREAMS, llm_process, snac_process

    logs = tmp_path_factory.mktemp("worker-logs")
    replicas = [snac_process().start(logs) for _ in range(2)]
    worker = llm_process([r.port for r in replicas], "--max-streams", str(WORKER_MAX_STREAMS),
                         "--min-streams", str(WORKER_MAX_STREAMS), "--grace-s", "120").start(logs)
    stack = {"worker": worker, "replicas": replicas, "url": f"http://127.0.0.1:{worker.port}", "logs": logs}
    try:
        for r in replicas:
            r.wait_ready()
        worker.wait_ready()
        yield stack
    finally:
        for p in [stack["worker"], *stack["replicas"]]:  # replicas a test restarted included
            p.stop()


STOPPERS = ("stops_the_megapod", "stops_the_worker")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "stops_the_megapod: ends the session's `megapod up`, so it runs after every other test")
    config.addinivalue_line("markers", "stops_the_worker: ends the session's worker_stack, so it runs after every other test")
    config.addinivalue_line("markers", "builds_the_images: waits for the images built in the background; runs last")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that end a session's stack run after every other test, and the image test after them: its
    images build in the background meanwhile (pytest_collection_finish)."""
    items.sort(key=lambda item: (item.get_closest_marker("builds_the_images") is not None,
                                 any(item.get_closest_marker(m) for m in STOPPERS)))  # stable: order kept


IMAGE_BUILD = pytest.StashKey[tuple[subprocess.Popen, Path]]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """The image test's build phase (deploy/images/build_and_run.py --phase build) starts now, in the
    background, its build steps held to half a CPU: minutes of pip and layer work overlap the other
    tests instead of following them. The test waits for it, then runs the containers."""
    if not any(item.get_closest_marker("builds_the_images") for item in session.items):
        return
    if os.environ.get("MEGAPOD_TEST_IMAGES") != "1":
        return
    work = Path(tempfile.mkdtemp(prefix="megapod-images-"))
    script = Path(__file__).resolve().parent.parent / "deploy" / "images" / "build_and_run.py"
    with open(work / "build.log", "w") as log:
        proc = subprocess.Popen([sys.executable, str(script), "--phase", "build", "--build-cpus", "0.5",
                                 "--result", str(work / "result-cpu.json")], stdout=log, stderr=subprocess.STDOUT)
    session.config.stash[IMAGE_BUILD] = (proc, work)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A build the session did not wait for (the image test deselected, failed early, interrupted) stops with it."""
    build = session.config.stash.get(IMAGE_BUILD, None)
    if build and build[0].poll() is None:
        build[0].terminate()  # the script unwinds on SIGTERM: no container is left
        try:
            build[0].wait(timeout=120)
        except subprocess.TimeoutExpired:
            build[0].kill()

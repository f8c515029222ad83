"""Shared fixtures: a real SNAC server on a loopback port, and the decoder it serves; the session's
`megapod up`."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
from hypothesis import settings


from codec_contract.api import codec_pb2_grpc
from codec_contract.client import channel
from snac_server.config import SnacServerConfig
from snac_server.server import build_server

from processes import TEST_CODEC


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


def waiting_for_first_audio():
    """A codec stream on a replica waiting for its first audio (its frames yet to come) for as long as it is
    registered (`service.streams.decoding(...)`): the replica's other streams past their bound are held meanwhile."""
    from types import SimpleNamespace

    from snac_server.service import _Stream
    from snac_server.session import SessionSettings

    return _Stream(SimpleNamespace(settings=SessionSettings(2, "streaming"), started=False, drained=False), 0)


def server_config(**overrides) -> SnacServerConfig:
    """Loopback, ephemeral ports, CPU, random weights of the small test codec: a config every test machine
    can run. What these servers are tested for (batching, sessions, resumes, bad input, the LLM tier
    around them) does not depend on the decoder's width, and the real width costs ~50x the CPU a frame
    (a whole decode of 64 frames: 6.8 s against 0.14 s here, one thread); the codec's own numerics are
    tested at the real width (test_streaming.py, test_codec_model.py, the recorded PCM in test_codec_server.py)."""
    values = dict(host="127.0.0.1", port=0, metrics_port=0, device="cpu", model=TEST_CODEC, max_wait_ms=20.0)
    values.update(overrides)
    return SnacServerConfig(**values)


@contextlib.asynccontextmanager
async def running_codec_server(**overrides):
    """A real grpc.aio codec server of server_config(**overrides), its `address` set, stopped after."""
    server, port = build_server(server_config(**overrides))
    await server.start()
    server.address = f"127.0.0.1:{port}"
    try:
        yield server
    finally:
        await server.stop(grace_s=1.0)


@pytest_asyncio.fixture(scope="module")
async def snac_server():
    """One real grpc.aio codec server per test module (model load and warm-up take seconds)."""
    async with running_codec_server() as server:
        yield server


@pytest_asyncio.fixture(scope="module")
async def stub(snac_server):
    """A client stub over a real loopback channel."""
    async with channel(snac_server.address) as ch:
        yield codec_pb2_grpc.SnacCodecStub(ch)


@pytest.fixture(scope="session")
def megapod(tmp_path_factory):
    """`megapod up` with 2 workers (WORKER_MAX_STREAMS streams each, a 1024-token context) and 2 codec replicas,
    as a user runs it: started once for every test that drives the whole stack, or one worker or replica
    of it directly (vLLM's start is most of a minute of CPU on two cores). Its drain grace is 60 s: the
    stream in flight at Ctrl-C (test_megapod.py) finishes within it on a loaded machine too."""
    from processes import WORKER_MAX_STREAMS, megapod_up

    with megapod_up(tmp_path_factory.mktemp("megapod-logs"), workers=2, replicas=2, max_streams=WORKER_MAX_STREAMS,
                    grace_s=60) as up:
        yield up


STOPPERS = ("stops_the_megapod",)
# Tests that share a session's stack run in one pytest-xdist worker (`make test` runs two, --dist loadgroup),
# so each stack starts once; every other test runs with the rest of its module, whose module-scoped
# fixtures (a doctor run, a codec server) would otherwise start once per worker.
SHARED_STACKS = ("megapod",)
# The longest groups first (a minute or more each on two cores), so that neither worker is left with one at
# the end while the other idles; then the rest in file order, the image test last (it waits for its build).
LONGEST_FIRST = ("megapod", "tests/test_doctor.py", "tests/test_gpu_kit.py", "tests/test_vllm_engine.py",
                 "tests/test_compiled_step.py", "tests/test_chart_parity.py", "tests/test_streaming.py", "tests/test_codec_model.py")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "stops_the_megapod: ends the session's `megapod up`, so it runs after every other test of it")
    config.addinivalue_line("markers", "builds_the_images: waits for the images built in the background; runs last")
    if _starts_the_image_build(config):
        # The build's folder is known before xdist starts its workers, which inherit the environment.
        os.environ[IMAGE_BUILD_DIR] = tempfile.mkdtemp(prefix="megapod-images-")


def _group(item: pytest.Item) -> str:
    stack = next((name for name in SHARED_STACKS if name in getattr(item, "fixturenames", ())), None)
    return stack or item.nodeid.split("::")[0]


def _order(item: pytest.Item) -> tuple[bool, int, bool]:
    group = _group(item)
    return (item.get_closest_marker("builds_the_images") is not None,
            LONGEST_FIRST.index(group) if group in LONGEST_FIRST else len(LONGEST_FIRST),
            any(item.get_closest_marker(m) for m in STOPPERS))


def pytest_itemcollected(item: pytest.Item) -> None:
    """Each test's xdist group, given as it is collected: before xdist's own hook reads it."""
    item.add_marker(pytest.mark.xdist_group(_group(item)))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Groups run longest first; a test that ends a shared stack runs after every other test of that
    stack, the image test after all: its images build meanwhile."""
    items.sort(key=_order)  # stable: file order otherwise


# The image test's build phase (deploy/images/build_and_run.py --phase build) runs in the background from
# the moment the tests are collected, its build steps held to half a CPU: minutes of pip and layer work
# overlap the other tests instead of following them. The process that started pytest owns it (under
# xdist, the controller); it writes the build's exit status to BUILD_RC in IMAGE_BUILD_DIR, which the
# test, in whichever worker, waits for before it runs the containers.
IMAGE_BUILD_DIR = "MEGAPOD_TEST_IMAGE_BUILD_DIR"
BUILD_RC = "build.rc"
IMAGE_BUILD = pytest.StashKey[subprocess.Popen]()
IMAGE_TEST = "test_images_run.py::"


def _starts_the_image_build(config: pytest.Config) -> bool:
    """Only the controller (or a run without xdist) builds, and only where `make test` opted in."""
    return os.environ.get("MEGAPOD_TEST_IMAGES") == "1" and not hasattr(config, "workerinput")


@pytest.fixture
def image_build() -> Path:
    """The folder of the background build phase, once that phase has ended (its status in BUILD_RC)."""
    work = Path(os.environ[IMAGE_BUILD_DIR])
    deadline = time.monotonic() + 5400
    while not (work / BUILD_RC).exists() and time.monotonic() < deadline:
        time.sleep(2)
    assert (work / BUILD_RC).exists(), f"the background image build did not end within 90 minutes: {work / 'build.log'}"
    return work


def _start_image_build(config: pytest.Config, nodeids: list[str]) -> None:
    if not _starts_the_image_build(config) or IMAGE_BUILD in config.stash:
        return
    if not any(IMAGE_TEST in nodeid for nodeid in nodeids):
        return
    work = Path(os.environ[IMAGE_BUILD_DIR])
    script = Path(__file__).resolve().parent.parent / "deploy" / "images" / "build_and_run.py"
    with open(work / "build.log", "w") as log:
        proc = subprocess.Popen([sys.executable, str(script), "--phase", "build", "--build-cpus", "0.5",
                                 "--result", str(work / "result-cpu.json")], stdout=log, stderr=subprocess.STDOUT)
    config.stash[IMAGE_BUILD] = proc
    threading.Thread(target=_record_status, args=(proc, work), daemon=True).start()


def _record_status(proc: subprocess.Popen, work: Path) -> None:
    """BUILD_RC once the build ends, written whole (renamed into place): the test waits for it to exist."""
    written = work / f"{BUILD_RC}.tmp"
    written.write_text(str(proc.wait()))
    written.replace(work / BUILD_RC)


def pytest_collection_finish(session: pytest.Session) -> None:
    _start_image_build(session.config, [item.nodeid for item in session.items])


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown when it is not installed
def pytest_xdist_node_collection_finished(node, ids: list[str]) -> None:
    """Under xdist the controller collects nothing: a worker's collection says whether the image test runs."""
    _start_image_build(node.config, ids)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A build the session did not wait for (the image test deselected, failed early, interrupted) stops with it."""
    build = session.config.stash.get(IMAGE_BUILD, None)
    if build and build.poll() is None:
        build.terminate()  # the script unwinds on SIGTERM: no container is left
        try:
            build.wait(timeout=120)
        except subprocess.TimeoutExpired:
            build.kill()

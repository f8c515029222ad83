"""The CPU images of both tiers and the front build from deploy/docker/ and the stack runs from them.

End to end with a real container engine (podman): deploy/images/build_and_run.py builds the base
stand-in, the three images, starts codec replica containers, an LLM worker container and the front's
on loopback, speaks through the front with `megapod say` and the openai SDK, and removes the containers.

`make test` runs it (it installs podman and sets MEGAPOD_TEST_IMAGES=1): the build phase starts in the
background when the tests are collected, its steps held to half a CPU, and this test, last, waits for
it, then runs the containers (tests/conftest.py; under pytest-xdist the controller builds). A cold build took 6.7 min alone on two cores, 2-4
min with the layers cached (deploy/README.md, "Building and running the images here"). A plain
`pytest` skips it, since it needs a container engine and about 1 GB of wheels.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import BUILD_RC
from processes import TEST_CODEC

from megapod.render import REPO

SCRIPT = REPO / "deploy" / "images" / "build_and_run.py"

opt_in = pytest.mark.skipif(
    os.environ.get("MEGAPOD_TEST_IMAGES") != "1",
    reason="builds both CPU images and runs the stack in containers (minutes, a container engine); "
           "`make test` sets MEGAPOD_TEST_IMAGES=1")


@opt_in
@pytest.mark.builds_the_images
@pytest.mark.timeout(7200)
def test_the_images_build_and_the_stack_speaks_from_them(image_build: Path) -> None:
    work = image_build
    result_path = work / "result-cpu.json"
    assert (work / BUILD_RC).read_text() == "0", (work / "build.log").read_text()[-4000:]  # the background build phase
    proc = subprocess.run([sys.executable, str(SCRIPT), "--phase", "run", "--snac-model", TEST_CODEC,
                           "--result", str(result_path)],
                          check=False, capture_output=True, text=True, timeout=1800)
    result = json.loads(result_path.read_text())
    assert proc.returncode == 0 and result["ok"], f"{result.get('error')}\n{proc.stderr[-4000:]}"
    assert result["phase"] == "run" and result["images_built"]

    images = result["images"]
    assert images.keys() == {"llm-server-cpu", "snac-server-cpu", "front"}
    for image in images.values():
        assert image["user"] == "10001:10001", image  # the chart's runAsUser, not root
    for name in ("llm-server-cpu", "snac-server-cpu"):
        assert images[name]["has_torch"] and images[name]["size_bytes"] > 100_000_000, images[name]
        assert images[name]["entrypoint"][0] in ("llm-server", "snac-server"), images[name]
    front = images["front"]
    assert not front["has_torch"] and front["entrypoint"] == ["python", "-m", "orpheus_front"], front
    assert front["size_bytes"] < images["llm-server-cpu"]["size_bytes"] / 4, front  # the point of its own image

    stack = result["stack"]
    assert len(stack["start_to_ready_s"]) == stack["codec_replicas"] + 2  # the replicas, the worker, the front
    assert stack["snac_model"].startswith(f"{TEST_CODEC} ")  # the small codec: the real layout, less CPU per frame

    say = result["megapod_say"]
    assert (say["sample_rate"], say["sample_width"], say["channels"]) == (24_000, 2, 1), say
    assert say["pcm_bytes"] > 0 and say["pcm_bytes"] % 2 == 0 and say["audio_s"] > 0, say

    stream = result["openai_stream"]
    assert stream["status"] == 200 and stream["bytes"] > 0 and stream["bytes"] % 2 == 0, stream
    assert 0 < stream["time_to_first_byte_s"] <= stream["total_s"], stream

    assert result["leftover_containers"] == [], "the script left containers running"


# ------------------------------------------- the loopback mirror the builds install from (always run)


def _module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_and_run", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _wheel(directory: Path, name: str, version: str) -> Path:
    """A minimal valid pure-Python wheel."""
    import base64
    import hashlib
    import zipfile

    dist = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f"VERSION = {version!r}\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(text.encode())}" for path, text in files.items()]
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    path = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for member, text in files.items():
            z.writestr(member, text)
    return path


def test_pip_installs_from_the_mirror_and_only_what_it_holds(tmp_path: Path) -> None:
    """The index the image builds use: real pip resolves a project through it (names normalized,
    sha256 checked) and finds nothing it does not hold."""
    module = _module()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "megapod_mirror_probe", "1.2.0")
    root = module.write_index(wheels, tmp_path / "mirror")
    port = module.free_ports(1)[0]
    mirror = module.Mirror(root, port)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--isolated", "--index-url", mirror.url,
                              "--dest", str(tmp_path / "out"), "Megapod.Mirror-Probe==1.2.0"],
                             check=False, capture_output=True, text=True, env=env, timeout=120)
        assert got.returncode == 0, got.stderr
        assert [p.name for p in (tmp_path / "out").iterdir()] == ["megapod_mirror_probe-1.2.0-py3-none-any.whl"]
        missing = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--isolated", "--index-url", mirror.url,
                                  "--dest", str(tmp_path / "out2"), "six"],
                                 check=False, capture_output=True, text=True, env=env, timeout=120)
        assert missing.returncode != 0 and "No matching distribution found for six" in missing.stderr
    finally:
        mirror.close()


# ------------------------------------------- disk space and failure messages (always run)


class EngineDouble:
    """Test double of build_and_run.Engine: a storage root and a record of the commands it got."""

    name = "podman"

    def __init__(self, root: Path, prune_error: str = "") -> None:
        self.root, self.calls, self.prune_error = root, [], prune_error

    def storage_root(self) -> Path:
        return self.root

    def __call__(self, *args: str, **kw) -> subprocess.CompletedProcess:
        self.calls.append(args)
        if self.prune_error and kw.get("check", True):
            raise AssertionError("a prune that can fail must not be checked: its failure would end the build")
        return subprocess.CompletedProcess(args, 125 if self.prune_error else 0, "", self.prune_error)


HELD = "Error: image used by 361972a15186: image is in use by a container: consider listing external containers"


@pytest.mark.parametrize("free_before, free_after, prune_error, fails", [
    (64.0, None, "", False),    # room: the layer cache stays
    (9.0, 40.0, "", False),     # short: earlier builds' untagged images go, then there is room
    (9.0, 12.0, "", True),      # still short: a clear failure before a build fills the disk
    (9.0, 40.0, HELD, False),   # an interrupted build's container holds one image: the prune fails, the rest went
    (9.0, 12.0, HELD, True),    # ... and if that was not enough, the failure says where to look
], ids=["room", "pruned", "still-short", "prune-refused", "prune-refused-still-short"])
def test_a_build_starts_only_with_room_for_it(tmp_path, monkeypatch, free_before, free_after, prune_error, fails) -> None:
    """A cold build filled this machine's disk mid-commit (CI: "storing layer ... read/write on
    closed pipe") with 13 GB free and ~55 GB held by untagged images of earlier builds. Later a
    killed build's leftover container held one image, podman refused the prune, and the build ended there."""
    module = _module()
    readings = iter([free_before, free_after])
    monkeypatch.setattr(module, "_free_gib", lambda path: next(readings))
    engine, result = EngineDouble(tmp_path, prune_error), {}
    pruned = free_before < 20
    if fails:
        hint = r".*external" if prune_error else ""
        with pytest.raises(module.Failure, match=rf"only 12\.0 GiB free .* needs 20 GiB{hint}"):
            module.ensure_space(engine, result)
    else:
        module.ensure_space(engine, result)
        assert result["disk"]["pruned_untagged_images"] is pruned and result["disk"]["prune_refused"] == prune_error
    assert engine.calls == ([("image", "prune", "-f")] if pruned else [])


def test_the_wheel_mirror_is_fetched_on_a_fresh_clone_whose_base_stand_in_is_already_built(tmp_path, monkeypatch) -> None:
    """A fresh clone has no deploy/images/.cache; with the base stand-in present (no debootstrap step to make
    it) and pyproject.toml changed (the mirror's key), the download must make it: it wrote its pin file
    into a folder that did not exist (a fresh clone's `make test` failed so)."""
    module = _module()
    monkeypatch.setattr(module, "CACHE", tmp_path / "clone" / "deploy" / "images" / ".cache")
    fetched = []

    def pip_download_double(cmd, **kw):  # test double of `pip download`: the CPU torch wheel's file, named
        dest = Path(cmd[cmd.index("--dest") + 1])
        (dest / f"torch-{module.TORCH_VERSION}+cpu-cp311-cp311-linux_x86_64.whl").write_bytes(b"")
        fetched.append(Path(cmd[cmd.index("--constraint") + 1]).read_text())

    monkeypatch.setattr(module, "run", pip_download_double)
    wheels = module.ensure_wheels(tmp_path / "wheels")
    assert fetched == [f"torch=={module.TORCH_VERSION}\n"] and any(wheels.glob(".complete-*"))


def test_a_failed_step_names_the_engines_error_first(tmp_path) -> None:
    """The error line leads the message: CI summaries cut the middle of a long build log."""
    module = _module()
    script = "for i in $(seq 60); do echo pip noise $i; done; echo 'Error: committing container: no space'; exit 125"
    with pytest.raises(module.Failure) as failure:
        module.run(["sh", "-c", script], log_to=tmp_path / "build.log")
    first_line = str(failure.value).splitlines()[0]
    assert "exited 125: Error: committing container: no space" in first_line
    assert "pip noise 60" in str(failure.value) and "pip noise 1\n" not in str(failure.value)

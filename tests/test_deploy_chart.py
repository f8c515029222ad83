"""The Kubernetes MegaPod as rendered: Helm chart (both profiles), kustomize overlays, cluster files.

Every check runs the real renderers (`helm template`, `kubectl kustomize`) and reads the objects
they produce; no cluster is needed. Helm and kubectl come from `make install` (deploy/tools/install_k8s_tools.py):
a missing helm or kubectl fails these tests instead of skipping them.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from concurrent import futures
from functools import cache
from pathlib import Path

import grpc
import kubernetes.client as k8s
import kubernetes_validate
import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from codec_contract.api import codec_pb2
from codec_contract.client import channel_credentials, tls_options
from llm_server.api import create_app
from llm_server.config import LlmServerConfig
from llm_server.engine.model_source import ORPHEUS_3B_CONFIG, resolve_model
from llm_server.metrics import LlmMetrics
from llm_server.speech.codec_client import channel_target
from llm_server.speech.prompt import prompt_ids
from megapod.cluster import CPU, H100, H100_FP8, MIG_INSTANCES_PER_GPU, PROFILES, ClusterProfile
from megapod.deploy import CUSTOM_PLURALS, KEEP_EXISTING, TYPED_KINDS, client_model
from megapod.render import (
    CHART,
    KUBE_VERSION,
    KUSTOMIZE,
    REPO,
    HelmRender,
    RenderError,
    find_helm,
    find_kubectl,
    parse_manifests,
    profile_values,
)
from megapod.topology import MegaPodConfig
from orpheus_front.front import FrontConfig
from snac_server.config import SnacServerConfig
from snac_server.server import server_credentials

# Kubernetes versions every object is validated against: the oldest the chart supports
# (Chart.yaml kubeVersion) and the newest kubernetes-validate 1.37.0 has schemas for.
KUBE_VERSIONS = (KUBE_VERSION, "1.37.0")
RELEASE = NAMESPACE = "orpheus-megapod"
CODEC_SERVICE = codec_pb2.DESCRIPTOR.services_by_name["SnacCodec"].full_name
GPU, MIG = "nvidia.com/gpu", "nvidia.com/mig-"
OPTIONAL_FEATURES = (
    "monitoring.podMonitor.enabled=true", "monitoring.rules.enabled=true", "monitoring.dashboard.enabled=true",
    "llm.autoscaling.enabled=true", "ingress.enabled=true",
    "ingress.host=tts.example.com", "service.type=LoadBalancer",
    "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.name=monitoring",
)


# ---------------------------------------------------------------- rendering


def leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    """A nested dict as dotted path -> value."""
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def helm() -> str:
    try:
        return find_helm()
    except RenderError as exc:
        pytest.fail(f"{exc} -- the chart's acceptance checks need it")


def kubectl() -> str:
    try:
        return find_kubectl()
    except RenderError as exc:
        pytest.fail(f"{exc} -- the kustomize checks need `kubectl kustomize`")


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=False)


@cache
def helm_render(profile: str = "h100", sets: tuple[str, ...] = ()) -> list[dict]:
    """`helm template` with the chart's own values only (the profile's file), as a user would."""
    argv = [helm(), "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION]
    if profile != "h100":
        argv += ["-f", str(CHART / PROFILES[profile].values_file)]
    for pair in sets:
        argv += ["--set", pair]
    done = run(*argv)
    assert done.returncode == 0, done.stderr
    return parse_manifests(done.stdout)


@cache
def kustomize_render(overlay: str) -> list[dict]:
    done = run(kubectl(), "kustomize", str(KUSTOMIZE / "overlays" / overlay))
    assert done.returncode == 0, done.stderr
    return parse_manifests(done.stdout)


RENDERS = {
    "helm-h100": lambda: helm_render("h100"),
    "kustomize-h100": lambda: kustomize_render("h100"),
    "helm-h100-fp8": lambda: helm_render("h100-fp8"),
    "helm-cpu": lambda: helm_render("cpu"),
    "kustomize-cpu": lambda: kustomize_render("cpu"),
}
GPU_RENDERS = ("helm-h100", "kustomize-h100", "helm-h100-fp8")
CPU_RENDERS = ("helm-cpu", "kustomize-cpu")


def profile_of(render: str) -> ClusterProfile:
    return PROFILES[render.split("-", 1)[1]]


def find(objects: list[dict], kind: str, name: str) -> dict:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def llm(objects: list[dict]) -> dict:
    return find(objects, "Deployment", f"{RELEASE}-llm")


def snac(objects: list[dict]) -> dict:
    return find(objects, "Deployment", f"{RELEASE}-snac")


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def env(deployment: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container(deployment)["env"]}


def limits(deployment: dict) -> dict:
    return container(deployment).get("resources", {}).get("limits", {})


def pod_labels(deployment: dict) -> dict:
    return deployment["spec"]["template"]["metadata"]["labels"]


def matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def port_named(deployment: dict, name: str) -> int:
    return next(p["containerPort"] for p in container(deployment)["ports"] if p["name"] == name)


# ---------------------------------------------------------------- Helm and schemas


@pytest.mark.parametrize("profile", ["h100", "h100-fp8", "cpu"])
def test_helm_lint_passes_strict(profile: str) -> None:
    argv = [helm(), "lint", "--strict", str(CHART)]
    if profile != "h100":
        argv += ["-f", str(CHART / PROFILES[profile].values_file)]
    done = run(*argv)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout


TLS_EXISTING = ("codecTls.existingSecret=my-codec-certs", "codecTls.existingClientSecret=my-codec-client-certs")
TLS_CERT_MANAGER = (
    "codecTls.certManager.enabled=true", "codecTls.certManager.issuerRef.name=megapod-ca",
    "codecTls.certManager.issuerRef.kind=ClusterIssuer",
)
TLS_OFF = ("codecTls.enabled=false",)
API_KEYS = ("apiKeys.existingSecret=orpheus-api-keys", "apiKeys.key=keys.txt")
# name -> (profile, --set pairs): the chart's optional features, alone and together.
VARIANTS = {
    "helm-h100-optional": ("h100", OPTIONAL_FEATURES),
    "helm-cpu-optional": ("cpu", OPTIONAL_FEATURES),
    "helm-pvc-model": ("h100", ("llm.model.source=pvc", "llm.model.pvc.claimName=orpheus-weights")),
    "helm-voices": ("h100", ("llm.voices.enabled=true",)),
    "helm-h100-tls-existing": ("h100", TLS_EXISTING),
    "helm-h100-cert-manager": ("h100", TLS_CERT_MANAGER),
    "helm-h100-tls-off": ("h100", TLS_OFF),
    "helm-h100-api-keys": ("h100", API_KEYS + ("codecTls.restartOnChange=true",)),
    "helm-cpu-cert-manager-api-keys": ("cpu", TLS_CERT_MANAGER + API_KEYS),
    "helm-cpu-tls-off-api-keys": ("cpu", TLS_OFF + API_KEYS),
    "helm-h100-front-tls": ("h100", ("front.tls.existingSecret=megapod-front-tls",)),
    "helm-h100-keda": ("h100", ("llm.autoscaling.enabled=true", "llm.autoscaling.autoscaler=keda",
                                "monitoring.podMonitor.enabled=true")),
}
VALIDATED = [*RENDERS, *VARIANTS]


def rendered(name: str) -> list[dict]:
    if name in VARIANTS:
        return helm_render(*VARIANTS[name])
    return RENDERS[name]()


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("name", VALIDATED)
def test_every_object_validates_against_the_kubernetes_schemas(name: str, version: str) -> None:
    objects = rendered(name)
    custom = [o for o in objects if (o["apiVersion"], o["kind"]) in CUSTOM_PLURALS]
    for obj in objects:
        if obj not in custom:  # strict: an unknown field anywhere fails
            kubernetes_validate.validate(obj, version, strict=True)
    # kubernetes-validate has no schema for CRD kinds; tests/test_observability.py and
    # test_codec_tls_from_cert_manager assert on them.
    assert {o["kind"] for o in custom} <= {"PodMonitor", "PrometheusRule", "Certificate", "ScaledObject"}
    assert len(objects) - len(custom) >= 8  # deployments, services, budgets, policy, account, ...


@pytest.mark.parametrize("name", VALIDATED)
def test_every_object_builds_the_kubernetes_clients_own_model(name: str) -> None:
    """megapod deploy creates typed objects: each must survive the client's model round trip."""
    api = k8s.ApiClient()
    for obj in rendered(name):
        key = (obj["apiVersion"], obj["kind"])
        assert key in TYPED_KINDS or key in CUSTOM_PLURALS, f"megapod deploy cannot apply {key}"
        if key in TYPED_KINDS:
            assert api.sanitize_for_serialization(client_model(obj).from_dict(obj)) == obj


# ---------------------------------------------------------------- one MegaPod, one config


def _merged_values(profile: ClusterProfile) -> dict:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    if profile.values_file != "values.yaml":
        values = _helm_merge(values, yaml.safe_load((CHART / profile.values_file).read_text()))
    return values


def _helm_merge(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        if value is None:
            merged.pop(key, None)  # Helm: null deletes a default
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _helm_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


@pytest.mark.parametrize("profile", [H100, H100_FP8, CPU], ids=lambda p: p.name)
def test_chart_values_files_are_the_cluster_profiles(profile: ClusterProfile) -> None:
    """values.yaml (+ values-cpu.yaml) hold exactly what megapod/cluster.py derives from MegaPodConfig."""
    values = leaves(_merged_values(profile))
    for key, expected in leaves(profile_values(profile)).items():
        assert values.get(key) == expected, f"{profile.values_file}: {key}={values.get(key)!r}, profile: {expected!r}"


def test_profile_knobs_not_overridden_are_megapod_config_defaults() -> None:
    """Ports, batch limits, policy and stream caps come from MegaPodConfig's own defaults."""
    default = MegaPodConfig()
    for profile in (H100, CPU):
        for name in ("front_port", "snac_base_port", "snac_metrics_base_port", "snac_max_batch", "snac_max_wait_ms",
                     "codec_policy", "max_streams_per_worker", "max_model_len"):
            assert getattr(profile.megapod, name) == getattr(default, name), name
    snac_server = SnacServerConfig()
    assert (default.snac_base_port, default.snac_metrics_base_port) == (snac_server.port, snac_server.metrics_port)
    assert default.front_port == LlmServerConfig().port


@pytest.mark.parametrize("profile", ["h100", "h100-fp8", "cpu"])
def test_megapod_deploy_values_render_the_charts_defaults(profile: str) -> None:
    """What `megapod deploy` renders (values from MegaPodConfig) equals the chart's own defaults
    (but for the certificates Helm generates anew on every render)."""
    ours = _without_generated_certs(parse_manifests(HelmRender(PROFILES[profile]).run(helm())))
    assert ours == _without_generated_certs(helm_render(profile))


def _without_generated_certs(objects: list[dict]) -> list[dict]:
    out = json.loads(json.dumps(objects))
    generated = [o for o in out if o["metadata"].get("annotations", {}).get(KEEP_EXISTING) == "true"]
    assert [o["kind"] for o in generated] == ["Secret"]  # the codec TLS Secret, on by default
    for secret in generated:
        secret["data"] = sorted(secret["data"])
    return out


def test_megapod_config_changes_reach_the_pods() -> None:
    pod = H100.megapod.replace(workers=5, snac_max_batch=64, codec_policy="reference", grace_s=90.0)
    objects = parse_manifests(HelmRender(dataclasses.replace(H100, megapod=pod)).run(helm()))
    assert llm(objects)["spec"]["replicas"] == 5
    assert env(snac(objects))["SNAC_MAX_BATCH"] == "64"
    assert env(snac(objects))["SNAC_POLICY"] == env(llm(objects))["ORPHEUS_CODEC_POLICY"] == "reference"
    assert llm(objects)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 90


def _pod_env(deployment: dict, prefix: str) -> dict[str, str]:
    values = {k: v for k, v in env(deployment).items() if k.startswith(prefix)}
    return {k: v.replace("$(POD_NAMESPACE)", NAMESPACE) for k, v in values.items()}


@pytest.mark.parametrize("render", list(RENDERS))
def test_pods_run_the_same_servers_as_megapod_up(render: str) -> None:
    """The pods' variables, parsed by the servers' own config loaders, equal the configs the local
    launcher builds from the same MegaPodConfig (MegaPodConfig.replica_flags / worker_flags), except the
    addresses that differ between one machine and a cluster."""
    objects, pod = RENDERS[render](), profile_of(render).megapod
    snac_pod = SnacServerConfig.from_cli([], _pod_env(snac(objects), "SNAC_"))
    snac_local = SnacServerConfig.from_cli(pod.replica_flags(0), {})
    tls = {"tls_cert": snac_local.tls_cert, "tls_key": snac_local.tls_key, "tls_client_ca": snac_local.tls_client_ca}
    # and the plaintext health port, which only the kubelet's probes use (test_chart_parity.py)
    assert snac_pod.replace(host=snac_local.host, health_port=snac_local.health_port, **tls) == snac_local
    llm_pod = LlmServerConfig.from_cli([], _pod_env(llm(objects), "ORPHEUS_"))
    llm_local = LlmServerConfig.from_cli(pod.worker_flags(0), {})
    # and the TLS and API key files, which only the cluster mounts (test_codec_tls_*), and the voices directory:
    # a path of this machine's cache locally; the chart has no voices volume yet (issue 26, item 4)
    differ = {"host", "port", "snac", "cache_dir", "api_keys_file", "codec_tls_ca", "codec_tls_cert", "codec_tls_key",
              "codec_tls_server_name", "voices_dir"}
    same = LlmServerConfig.model_fields.keys() - differ
    assert {n: getattr(llm_pod, n) for n in same} == {n: getattr(llm_local, n) for n in same}
    assert (snac_pod.host, llm_pod.host) == ("0.0.0.0", "0.0.0.0")  # the servers' own default


# ---------------------------------------------------------------- topology


@pytest.mark.parametrize("render", GPU_RENDERS)
def test_h100_workers_run_trtllm_decode_attention(render: str) -> None:
    """The H100 profile asks vLLM for FlashInfer's TRT-LLM kernels (XQA decode on Hopper); the worker
    parses these variables into the settings llm_server.engine.attention checks."""
    variables = env(llm(RENDERS[render]()))
    assert (variables["ORPHEUS_ATTENTION_BACKEND"], variables["ORPHEUS_TRTLLM_ATTENTION"]) == ("FLASHINFER", "on")


@pytest.mark.parametrize("render", GPU_RENDERS)
def test_seven_llm_pods_with_one_gpu_each(render: str) -> None:
    deployment = llm(RENDERS[render]())
    assert deployment["spec"]["replicas"] == 7
    assert limits(deployment)[GPU] == "1"
    assert not any(r.startswith(MIG) for r in limits(deployment))
    assert env(deployment)["ORPHEUS_DEVICE"] == "cuda"


@pytest.mark.parametrize("render", GPU_RENDERS)
def test_three_snac_pods_share_the_one_remaining_gpu_through_mig(render: str) -> None:
    objects = RENDERS[render]()
    deployment = snac(objects)
    resources = container(deployment)["resources"]
    assert deployment["spec"]["replicas"] == 3
    assert GPU not in resources.get("limits", {}) and GPU not in resources.get("requests", {})
    (mig,) = [r for r in resources["limits"] if r.startswith(MIG)]
    assert resources["limits"][mig] == "1"
    instances_per_gpu = MIG_INSTANCES_PER_GPU[mig.removeprefix(MIG)]
    assert deployment["spec"]["replicas"] <= instances_per_gpu  # all three fit on one GPU
    whole = sum(d["spec"]["replicas"] * int(limits(d).get(GPU, 0)) for d in objects if d["kind"] == "Deployment")
    assert whole + math.ceil(deployment["spec"]["replicas"] / instances_per_gpu) <= 8
    assert H100.gpus_needed() == whole + 1 == 8


@pytest.mark.parametrize("render", GPU_RENDERS)
def test_the_megapod_stays_on_one_node(render: str) -> None:
    objects = RENDERS[render]()
    tiers = [llm(objects), snac(objects)]
    for deployment in tiers:
        spec = deployment["spec"]["template"]["spec"]
        assert spec["nodeSelector"] == {"orpheus-megapod/role": "megapod"}
        (term,) = spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert all(matches(term["labelSelector"]["matchLabels"], pod_labels(t)) for t in tiers)


@pytest.mark.parametrize("render", CPU_RENDERS)
def test_cpu_profile_requests_no_accelerator(render: str) -> None:
    objects = RENDERS[render]()
    assert "nvidia.com" not in json.dumps(objects)
    for deployment, var in ((llm(objects), "ORPHEUS_DEVICE"), (snac(objects), "SNAC_DEVICE")):
        assert env(deployment)[var] == "cpu"
        spec = deployment["spec"]["template"]["spec"]
        assert not spec.get("nodeSelector") and not spec.get("affinity") and not spec.get("tolerations")
    assert env(llm(objects))["ORPHEUS_ENFORCE_EAGER"] == "true"
    assert llm(objects)["spec"]["replicas"] == CPU.megapod.workers
    assert snac(objects)["spec"]["replicas"] == CPU.megapod.replicas


@pytest.mark.parametrize("render", list(RENDERS))
def test_ports_and_probes_match_the_servers(render: str) -> None:
    objects = RENDERS[render]()
    worker, codec = llm(objects), snac(objects)
    http = port_named(worker, "http")
    assert http == LlmServerConfig().port == int(env(worker)["ORPHEUS_PORT"])
    routes = {r.path for r in create_app(LlmServerConfig()).routes}
    probe_paths = {container(worker)[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probe_paths <= routes and container(worker)["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container(worker)["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    grpc, metrics, health = port_named(codec, "grpc"), port_named(codec, "metrics"), port_named(codec, "health")
    assert (grpc, metrics) == (SnacServerConfig().port, SnacServerConfig().metrics_port)
    assert (int(env(codec)["SNAC_PORT"]), int(env(codec)["SNAC_METRICS_PORT"])) == (grpc, metrics)
    assert int(env(codec)["SNAC_HEALTH_PORT"]) == health not in (grpc, metrics)
    targets = {probe: snac_probe_target(codec, probe) for probe in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert targets == {"startupProbe": (health, CODEC_SERVICE), "livenessProbe": (health, ""),
                       "readinessProbe": (health, CODEC_SERVICE)}


def snac_probe_target(deployment: dict, probe: str) -> tuple[int, str]:
    """(port, grpc.health.v1 service) a SNAC probe checks: the kubelet's own grpc probe, on the
    plaintext health-only port whether codec TLS is on or off (test_chart_parity.py runs it)."""
    spec = container(deployment)[probe]
    assert set(spec) - {"grpc"} <= {"periodSeconds", "timeoutSeconds", "failureThreshold", "successThreshold",
                                    "initialDelaySeconds"}
    return spec["grpc"]["port"], spec["grpc"].get("service", "")


@pytest.mark.parametrize("render", list(RENDERS))
def test_llm_workers_reach_snac_through_the_headless_service(render: str) -> None:
    objects = RENDERS[render]()
    service = find(objects, "Service", f"{RELEASE}-snac")
    assert service["spec"]["clusterIP"] == "None"
    assert not service["spec"].get("publishNotReadyAddresses")
    assert matches(service["spec"]["selector"], pod_labels(snac(objects)))
    assert not matches(service["spec"]["selector"], pod_labels(llm(objects)))
    (grpc,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
    assert grpc["targetPort"] == "grpc"
    names = [e["name"] for e in container(llm(objects))["env"]]
    assert names.index("POD_NAMESPACE") < names.index("ORPHEUS_SNAC")  # $(POD_NAMESPACE) expands
    target = env(llm(objects))["ORPHEUS_SNAC"]
    assert target == f"dns:///{RELEASE}-snac.$(POD_NAMESPACE).svc.cluster.local:{grpc['port']}"
    assert channel_target(target) == target  # the codec client resolves it as one DNS name
    assert float(env(snac(objects))["SNAC_MAX_CONNECTION_AGE_S"]) > 0  # so workers re-resolve


@pytest.mark.parametrize("render", list(RENDERS))
def test_voice_agents_service(render: str) -> None:
    objects = RENDERS[render]()
    service = find(objects, "Service", RELEASE)
    (port,) = service["spec"]["ports"]
    assert port["port"] == profile_of(render).megapod.front_port and port["targetPort"] == "http"
    front = find(objects, "Deployment", f"{RELEASE}-front")  # the front picks each stream's worker
    assert service["spec"]["selector"] == front["spec"]["selector"]["matchLabels"]
    assert service["spec"]["sessionAffinity"] == "None"


def test_streaming_settings_on_load_balancer_and_ingress() -> None:
    objects = helm_render("h100", OPTIONAL_FEATURES)
    assert find(objects, "Service", RELEASE)["spec"]["externalTrafficPolicy"] == "Local"
    annotations = find(objects, "Ingress", RELEASE)["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert int(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 600


@pytest.mark.parametrize("render", list(RENDERS))
def test_network_policy_lets_only_llm_workers_reach_snac(render: str) -> None:
    objects = RENDERS[render]()
    policy = find(objects, "NetworkPolicy", f"{RELEASE}-snac")["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    assert matches(policy["podSelector"]["matchLabels"], pod_labels(snac(objects)))
    assert not matches(policy["podSelector"]["matchLabels"], pod_labels(llm(objects)))
    (rule,) = policy["ingress"]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"} and matches(peer["podSelector"]["matchLabels"], pod_labels(llm(objects)))
    assert not matches(peer["podSelector"]["matchLabels"], pod_labels(snac(objects)))
    assert rule["ports"] == [{"port": port_named(snac(objects), "grpc"), "protocol": "TCP"}]


def test_network_policy_opens_only_the_metrics_port_to_scrapers() -> None:
    objects = helm_render("h100", OPTIONAL_FEATURES)
    _, scrape = find(objects, "NetworkPolicy", f"{RELEASE}-snac")["spec"]["ingress"]
    assert scrape["ports"] == [{"port": port_named(snac(objects), "metrics"), "protocol": "TCP"}]


@pytest.mark.parametrize("render", list(RENDERS))
def test_disruption_budgets_take_one_pod_of_a_tier_at_a_time(render: str) -> None:
    objects = RENDERS[render]()
    for deployment in (llm(objects), snac(objects)):
        budget = find(objects, "PodDisruptionBudget", deployment["metadata"]["name"])["spec"]
        assert budget["selector"] == deployment["spec"]["selector"]
        assert budget["maxUnavailable"] == 1 < deployment["spec"]["replicas"]
        assert budget["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_disruption_budgets_follow_the_deployments_truncated_names() -> None:
    objects = helm_render("h100", ("fullnameOverride=" + "x" * 63,))
    for deployment in (o for o in objects if o["kind"] == "Deployment"):
        assert len(deployment["metadata"]["name"]) <= 63
        find(objects, "PodDisruptionBudget", deployment["metadata"]["name"])


@pytest.mark.parametrize("render", list(RENDERS))
def test_rollouts_drain_streams_and_never_surge(render: str) -> None:
    objects = RENDERS[render]()
    for deployment, grace_var in ((llm(objects), "ORPHEUS_GRACE_S"), (snac(objects), "SNAC_GRACE_S")):
        assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
        spec = deployment["spec"]["template"]["spec"]
        command = container(deployment)["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep" and int(command[1]) > 0
        drain = int(command[1]) + float(env(deployment)[grace_var])
        assert spec["terminationGracePeriodSeconds"] > drain
        assert float(env(deployment)[grace_var]) == profile_of(render).megapod.grace_s
        assert spec["enableServiceLinks"] is False  # a Service named snac would set SNAC_PORT


@pytest.mark.parametrize("render", list(RENDERS))
def test_pods_run_as_non_root_with_a_read_only_root(render: str) -> None:
    for deployment in (llm(RENDERS[render]()), snac(RENDERS[render]())):
        assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
        assert container(deployment)["securityContext"]["readOnlyRootFilesystem"] is True
        assert container(deployment)["resources"]["requests"]["memory"]


KEDA_CRD = Path(__file__).parent / "data" / "keda-v2.20.2-scaledobjects.yaml"


def pruned(obj: object, schema: dict, where: str = "") -> list[str]:
    """The fields of `obj` a structural schema does not declare: what the API server would prune (metadata is
    the API server's own)."""
    if isinstance(obj, dict) and "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        props = schema["properties"]
        return [f"{where}.{k}" for k in obj if k not in props] + [
            found for k, v in obj.items() if k in props and k != "metadata" for found in pruned(v, props[k], f"{where}.{k}")]
    if isinstance(obj, list) and "items" in schema:
        return [found for i, v in enumerate(obj) for found in pruned(v, schema["items"], f"{where}[{i}]")]
    return []


def test_keda_scales_workers_from_prometheus_on_capacity_refusals_and_first_audio() -> None:
    """llm.autoscaling.autoscaler=keda (issue 46): a ScaledObject valid against KEDA's own CRD schema, its three
    Prometheus triggers valid PromQL on this release's series, one worker down at a time; no HPA of the chart's
    own beside the one KEDA makes; refused without the PodMonitor whose labels its queries select."""
    import jsonschema
    from test_observability import selectors

    objects = rendered("helm-h100-keda")
    assert not [o for o in objects if o["kind"] == "HorizontalPodAutoscaler"]
    scaled = find(objects, "ScaledObject", f"{RELEASE}-llm")
    (version,) = [v for v in yaml.safe_load(KEDA_CRD.read_text())["spec"]["versions"] if v["name"] == "v1alpha1"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    schema = version["schema"]["openAPIV3Schema"]
    jsonschema.validate(scaled, schema)
    assert pruned(scaled, schema) == [], "the API server drops fields its schema does not know, in silence"
    assert pruned({**scaled, "spec": {**scaled["spec"], "triggerz": []}}, schema) == [".spec.triggerz"]
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["name"] == llm(objects)["metadata"]["name"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, H100.gpus_per_node - H100.snac_gpus())
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["policies"] == [
        {"type": "Pods", "value": 1, "periodSeconds": 300}]
    triggers = {t["name"]: t for t in spec["triggers"]}
    assert set(triggers) == {"capacity-used", "refused", "time-to-first-audio-p95"}
    for trigger in triggers.values():
        assert (trigger["type"], trigger["metricType"]) == ("prometheus", "Value")
        query = trigger["metadata"]["query"]
        for selector in selectors(query)[0]:  # parses, or raises
            matchers = {(m.name, m.value) for m in selector.matchers.matchers}
            assert {("namespace", NAMESPACE), ("release", RELEASE)} <= matchers, query
        assert float(trigger["metadata"]["threshold"]) > 0
    assert "megapod_worker_capacity_used_ratio" in triggers["capacity-used"]["metadata"]["query"]
    assert 'cause="capacity"' in triggers["refused"]["metadata"]["query"]
    done = run(helm(), "template", RELEASE, str(CHART), "--set", "llm.autoscaling.enabled=true",
               "--set", "llm.autoscaling.autoscaler=keda")
    assert done.returncode != 0 and "monitoring.podMonitor.enabled=true" in done.stderr


def test_autoscaling_on_the_share_of_measured_capacity_held() -> None:
    """A fixed active-stream target (12) was stale once each worker measures its own limit."""
    objects = helm_render("h100", OPTIONAL_FEATURES)
    hpa = find(objects, "HorizontalPodAutoscaler", f"{RELEASE}-llm")["spec"]
    assert hpa["scaleTargetRef"]["name"] == llm(objects)["metadata"]["name"]
    assert "replicas" not in llm(objects)["spec"]  # the autoscaler owns it
    assert hpa["maxReplicas"] <= H100.gpus_per_node - H100.snac_gpus()
    (metric,) = hpa["metrics"]
    assert metric["pods"]["metric"]["name"] == "megapod_worker_capacity_used_ratio"
    assert metric["pods"]["metric"]["name"] in {m.name for m in LlmMetrics(lambda: 0).registry.collect()}
    assert 0 < float(metric["pods"]["target"]["averageValue"]) <= 1


@pytest.mark.parametrize("render", ["helm-h100", "kustomize-h100"])
def test_what_compiles_at_start_is_kept_on_the_cache_claim_not_in_home(render: str) -> None:
    """vLLM keeps its torch.compile artifacts under ~/.cache/vllm (envs.py: VLLM_CACHE_ROOT), Triton, Inductor and
    FlashInfer theirs under HOME or /tmp too: emptyDirs, so each of the seven pods compiled again at every start
    (issue 44, finding 5). Each goes under the cache claim's mount instead."""
    worker = llm(rendered(render))
    (cache,) = [m for m in container(worker)["volumeMounts"] if m["name"] == "cache"]
    (volume,) = [v for v in worker["spec"]["template"]["spec"]["volumes"] if v["name"] == "cache"]
    assert "persistentVolumeClaim" in volume
    home = env(worker)["HOME"]
    for name in ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE"):
        path = env(worker).get(name)
        assert path and Path(path).is_relative_to(cache["mountPath"]) and not Path(path).is_relative_to(home), name
    # The codec replicas compile their streaming step on a GPU (issue 45): theirs too.
    replica = next(o for o in rendered(render) if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-snac"))
    (mount,) = [m for m in container(replica)["volumeMounts"] if m["name"] == "cache"]
    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        path = env(replica).get(name)
        assert path and Path(path).is_relative_to(mount["mountPath"]) and not Path(path).is_relative_to(env(replica)["HOME"]), name


def test_model_from_a_volume_claim() -> None:
    objects = helm_render("h100", ("llm.model.source=pvc", "llm.model.pvc.claimName=orpheus-weights"))
    worker = llm(objects)
    assert env(worker)["ORPHEUS_MODEL"] == "/models/orpheus-3b-0.1-ft" and env(worker)["HF_HUB_OFFLINE"] == "1"
    volume = next(v for v in worker["spec"]["template"]["spec"]["volumes"] if v["name"] == "models")
    assert volume["persistentVolumeClaim"] == {"claimName": "orpheus-weights", "readOnly": True}
    assert not any(o["kind"] == "PersistentVolumeClaim" for o in objects)
    done = run(helm(), "template", RELEASE, str(CHART), "--set", "llm.model.source=pvc")
    assert done.returncode != 0 and "claimName is required" in done.stderr


def test_voices_from_one_claim_every_worker_mounts() -> None:
    assert not any(o["kind"] == "PersistentVolumeClaim" and o["metadata"]["name"].endswith("-voices")
                   for o in helm_render("h100"))  # off by default: no voices directory
    assert "ORPHEUS_VOICES_DIR" not in env(llm(helm_render("h100")))
    objects = helm_render("h100", ("llm.voices.enabled=true",))
    worker, claim = llm(objects), find(objects, "PersistentVolumeClaim", f"{RELEASE}-voices")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # clones are written by whichever worker made them
    assert env(worker)["ORPHEUS_VOICES_DIR"] == mount(worker, "voices")["mountPath"] == "/voices"
    assert volume(worker, "voices")["persistentVolumeClaim"] == {"claimName": claim["metadata"]["name"], "readOnly": False}
    objects = helm_render("h100", ("llm.voices.enabled=true", "llm.voices.existingClaim=team-voices",
                                   "llm.voices.readOnly=true"))
    worker = llm(objects)
    assert volume(worker, "voices")["persistentVolumeClaim"] == {"claimName": "team-voices", "readOnly": True}
    assert mount(worker, "voices")["readOnly"] is True
    assert not any(o["kind"] == "PersistentVolumeClaim" and "voices" in o["metadata"]["name"] for o in objects)


# ---------------------------------------------------------------- codec TLS, API keys


TLS_DIR = "/etc/orpheus-megapod/codec-tls"
TLS_ENV = {  # the servers' variables -> the file each must name in the mount
    "snac": {"SNAC_TLS_CERT": "tls.crt", "SNAC_TLS_KEY": "tls.key", "SNAC_TLS_CLIENT_CA": "ca.crt"},
    "llm": {"ORPHEUS_CODEC_TLS_CERT": "tls.crt", "ORPHEUS_CODEC_TLS_KEY": "tls.key", "ORPHEUS_CODEC_TLS_CA": "ca.crt"},
}


def pod_spec(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def volume(deployment: dict, name: str) -> dict | None:
    return next((v for v in pod_spec(deployment).get("volumes", []) if v["name"] == name), None)


def mount(deployment: dict, name: str) -> dict | None:
    return next((m for m in container(deployment).get("volumeMounts", []) if m["name"] == name), None)


def server_name(deployment: dict, var: str) -> str:
    return env(deployment)[var].replace("$(POD_NAMESPACE)", NAMESPACE)


def generated_secret(objects: list[dict]) -> dict:
    (secret,) = [o for o in objects if o["kind"] == "Secret"]
    return secret


def load_cert(pem: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem)


def write_mount(objects: list[dict], deployment: dict, where: Path) -> dict[str, str]:
    """Lay the codec-tls volume out as kubelet would (the generated Secret's keys, as the volume's
    items name them) and return the pod's variables with their paths moved to `where`."""
    data = generated_secret(objects)["data"]
    where.mkdir()
    for item in volume(deployment, "codec-tls")["secret"]["items"]:
        (where / item["path"]).write_bytes(base64.b64decode(data[item["key"]]))
    values = {k: v.replace("$(POD_NAMESPACE)", NAMESPACE) for k, v in env(deployment).items() if v is not None}
    return {k: v.replace(TLS_DIR, str(where)) for k, v in values.items()}


@pytest.mark.parametrize("render", ["helm-h100", "helm-cpu", "kustomize-h100", "kustomize-cpu"])
def test_codec_tls_is_on_by_default_with_client_certificates(render: str) -> None:
    objects = RENDERS[render]()
    names = {}
    for deployment, tier in ((snac(objects), "snac"), (llm(objects), "llm")):
        tls_mount, tls_volume = mount(deployment, "codec-tls"), volume(deployment, "codec-tls")
        assert tls_mount == {"name": "codec-tls", "mountPath": TLS_DIR, "readOnly": True}  # no subPath
        files = [item["path"] for item in tls_volume["secret"]["items"]]
        assert sorted(files) == ["ca.crt", "tls.crt", "tls.key"] and tls_volume["secret"]["defaultMode"] == 0o440
        for var, file in TLS_ENV[tier].items():
            assert env(deployment)[var] == f"{TLS_DIR}/{file}"  # a file the volume puts there
        names[tier] = tls_volume["secret"]["secretName"]
    if render.startswith("helm"):
        secret = generated_secret(objects)
        assert names == {"snac": secret["metadata"]["name"], "llm": secret["metadata"]["name"]}
        assert secret["metadata"]["annotations"][KEEP_EXISTING] == "true"  # megapod deploy keeps it
        items = {t: {i["path"]: i["key"] for i in volume(d, "codec-tls")["secret"]["items"]}
                 for t, d in (("snac", snac(objects)), ("llm", llm(objects)))}
        assert items == {"snac": {"ca.crt": "ca.crt", "tls.crt": "server.crt", "tls.key": "server.key"},
                         "llm": {"ca.crt": "ca.crt", "tls.crt": "client.crt", "tls.key": "client.key"}}
    else:
        assert set(names.values()) == {_load_tool("render_k8s").BASE_TLS_SECRET}  # deploy/README.md creates it
        assert not any(o["kind"] == "Secret" for o in objects)
    # The name the workers check is the host they dial.
    dialed = env(llm(objects))["ORPHEUS_SNAC"].removeprefix("dns:///").rsplit(":", 1)[0]
    assert env(llm(objects))["ORPHEUS_CODEC_TLS_SERVER_NAME"] == dialed
    # The servers' own loaders accept the variables (cert and key together, CA present).
    snac_pod = SnacServerConfig.from_cli([], _pod_env(snac(objects), "SNAC_"))
    llm_pod = LlmServerConfig.from_cli([], _pod_env(llm(objects), "ORPHEUS_"))
    assert snac_pod.tls_client_ca and llm_pod.codec_tls_cert and not llm_pod.api_keys_file


def test_generated_certificates_chain_to_the_ca_and_name_the_snac_service() -> None:
    objects = helm_render("h100")
    data = {k: base64.b64decode(v) for k, v in generated_secret(objects)["data"].items()}
    assert sorted(data) == ["ca.crt", "client.crt", "client.key", "server.crt", "server.key"]  # no CA key
    ca, server, client = (load_cert(data[k]) for k in ("ca.crt", "server.crt", "client.crt"))
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for leaf in (server, client):
        leaf.verify_directly_issued_by(ca)
        assert leaf.not_valid_after_utc - leaf.not_valid_before_utc > dt.timedelta(days=365)
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    name = server_name(llm(objects), "ORPHEUS_CODEC_TLS_SERVER_NAME")
    assert name == f"{RELEASE}-snac.{NAMESPACE}.svc.cluster.local" and name in sans
    assert f"{RELEASE}-snac.{NAMESPACE}.svc" in sans
    usages = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in usages
    assert ExtendedKeyUsageOID.CLIENT_AUTH in client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert data["server.key"] != data["client.key"]
    # Another render (no cluster to look the Secret up in) generates other certificates.
    again = generated_secret(helm_render("h100", ("codecTls.enabled=true",)))["data"]
    assert again["ca.crt"] != generated_secret(objects)["data"]["ca.crt"]


def _health_server(config: SnacServerConfig) -> tuple[grpc.Server, health.HealthServicer, int]:
    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(config))  # the snac-server's own TLS
    server.start()
    return server, servicer, port


def _check(port: int, credentials: grpc.ChannelCredentials, name: str) -> int:
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials, tls_options(name)) as channel:
        request = health_pb2.HealthCheckRequest(service=CODEC_SERVICE)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


def test_codec_tls_works_with_the_rendered_files_and_names(tmp_path: Path) -> None:
    """The generated certificates, laid out as the pods mount them, carry a mutual TLS handshake:
    the snac-server's TLS (from the pod's variables) accepts the LLM worker's client (from its
    variables) checking the rendered server name, and refuses clients without a certificate.
    (The probes: tests/test_chart_parity.py.)"""
    objects = helm_render("h100")
    snac_env = write_mount(objects, snac(objects), tmp_path / "snac")
    llm_env = write_mount(objects, llm(objects), tmp_path / "llm")
    snac_config = SnacServerConfig.from_cli([], {k: v for k, v in snac_env.items() if k.startswith("SNAC_")})
    worker = LlmServerConfig.from_cli([], {k: v for k, v in llm_env.items() if k.startswith("ORPHEUS_")})
    server, servicer, port = _health_server(snac_config.replace(port=0))
    try:
        servicer.set(CODEC_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        client = channel_credentials(worker.codec_tls_ca, worker.codec_tls_cert, worker.codec_tls_key)
        assert _check(port, client, worker.codec_tls_server_name) == health_pb2.HealthCheckResponse.SERVING
        for refused, name in ((channel_credentials(worker.codec_tls_ca), worker.codec_tls_server_name),
                              (client, "someone-else.example.com")):
            with pytest.raises(grpc.RpcError) as failed:
                _check(port, refused, name)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)


def test_codec_tls_from_existing_secrets() -> None:
    objects = helm_render("h100", TLS_EXISTING)
    assert not any(o["kind"] in ("Secret", "Certificate") for o in objects)
    for deployment, secret in ((snac(objects), "my-codec-certs"), (llm(objects), "my-codec-client-certs")):
        items = volume(deployment, "codec-tls")["secret"]
        assert items["secretName"] == secret
        assert {i["key"]: i["path"] for i in items["items"]} == {"ca.crt": "ca.crt", "tls.crt": "tls.crt", "tls.key": "tls.key"}
    single = helm_render("h100", ("codecTls.existingSecret=my-codec-certs",))  # one pair for both tiers
    assert {volume(d, "codec-tls")["secret"]["secretName"] for d in (snac(single), llm(single))} == {"my-codec-certs"}
    both = run(helm(), "template", RELEASE, str(CHART), "--set", TLS_EXISTING[0], "--set", TLS_CERT_MANAGER[0],
               "--set", TLS_CERT_MANAGER[1])
    assert both.returncode != 0 and "not both" in both.stderr


def test_codec_tls_from_cert_manager() -> None:
    """cert-manager's CRDs are not in kubernetes-validate: the Certificates' structure is checked here."""
    objects = helm_render("h100", TLS_CERT_MANAGER)
    assert not any(o["kind"] == "Secret" for o in objects)
    certificates = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Certificate"}
    assert len(certificates) == 2
    for side, deployment in (("server", snac(objects)), ("client", llm(objects))):
        certificate = certificates[f"{RELEASE}-codec-tls-{side}"]
        assert certificate["apiVersion"] == "cert-manager.io/v1"
        assert certificate["metadata"]["namespace"] == NAMESPACE
        spec = certificate["spec"]
        assert set(spec) <= {"secretName", "commonName", "dnsNames", "usages", "duration", "renewBefore",
                             "privateKey", "issuerRef"}
        assert spec["issuerRef"] == {"name": "megapod-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
        assert spec["secretName"] == volume(deployment, "codec-tls")["secret"]["secretName"]
        assert spec["privateKey"]["rotationPolicy"] == "Always"
    server = certificates[f"{RELEASE}-codec-tls-server"]["spec"]
    assert "server auth" in server["usages"] and "client auth" not in server["usages"]  # no probe presents it
    assert "client auth" in certificates[f"{RELEASE}-codec-tls-client"]["spec"]["usages"]  # the LLM workers'
    assert server_name(llm(objects), "ORPHEUS_CODEC_TLS_SERVER_NAME") in server["dnsNames"]
    assert "dnsNames" not in certificates[f"{RELEASE}-codec-tls-client"]["spec"]
    assert not any(o["kind"] == "Certificate" for o in helm_render("h100"))  # only when enabled
    done = run(helm(), "template", RELEASE, str(CHART), "--set", TLS_CERT_MANAGER[0])
    assert done.returncode != 0 and "issuerRef.name is required" in done.stderr


@pytest.mark.parametrize("name", ["helm-h100-tls-off", "helm-cpu-tls-off-api-keys"])
def test_codec_tls_off_leaves_no_trace(name: str) -> None:
    objects = rendered(name)
    assert not any(o["kind"] in ("Secret", "Certificate") for o in objects)
    for deployment in (snac(objects), llm(objects)):
        assert volume(deployment, "codec-tls") is None and mount(deployment, "codec-tls") is None
        assert not [k for k in env(deployment) if "TLS" in k]
        assert "annotations" not in deployment["spec"]["template"]["metadata"]
    assert snac_probe_target(snac(objects), "readinessProbe") == (port_named(snac(objects), "health"), CODEC_SERVICE)
    snac_pod = SnacServerConfig.from_cli([], _pod_env(snac(objects), "SNAC_"))
    llm_pod = LlmServerConfig.from_cli([], _pod_env(llm(objects), "ORPHEUS_"))
    assert (snac_pod.tls_cert, llm_pod.codec_tls_ca) == ("", "")


def test_the_front_serves_tls_from_a_secret_and_is_probed_over_https() -> None:
    """front.tls.existingSecret (issue 46): the Secret's pair mounted read-only, the front's own TLS settings
    pointed at it (re-read on change, orpheus_common/tls.py), the kubelet's probes in HTTPS; off by default."""
    front = find(rendered("helm-h100-front-tls"), "Deployment", f"{RELEASE}-front")
    assert mount(front, "tls") == {"name": "tls", "mountPath": "/etc/megapod/tls", "readOnly": True}
    assert volume(front, "tls")["secret"]["secretName"] == "megapod-front-tls"
    served = {item["path"] for item in volume(front, "tls")["secret"]["items"]}
    config = FrontConfig.from_cli([], _pod_env(front, "MEGAPOD_FRONT_"))
    assert config.scheme == "https" and {Path(config.ssl_certfile).name, Path(config.ssl_keyfile).name} == served
    assert {Path(config.ssl_certfile).parent, Path(config.ssl_keyfile).parent} == {Path("/etc/megapod/tls")}
    assert [container(front)[p]["httpGet"]["scheme"] for p in ("livenessProbe", "readinessProbe")] == ["HTTPS"] * 2
    plain = find(helm_render("h100"), "Deployment", f"{RELEASE}-front")
    assert volume(plain, "tls") is None and FrontConfig.from_cli([], _pod_env(plain, "MEGAPOD_FRONT_")).scheme == "http"
    assert container(plain)["readinessProbe"]["httpGet"]["scheme"] == "HTTP"


@pytest.mark.parametrize("name", ["helm-h100-api-keys", "helm-cpu-cert-manager-api-keys", "helm-cpu-tls-off-api-keys"])
def test_api_keys_file_from_a_secret(name: str) -> None:
    objects = rendered(name)
    worker = llm(objects)
    keys_mount = mount(worker, "api-keys")
    assert keys_mount == {"name": "api-keys", "mountPath": "/etc/orpheus-megapod/api-keys", "readOnly": True}
    secret = volume(worker, "api-keys")["secret"]
    assert secret["secretName"] == "orpheus-api-keys" and secret["defaultMode"] == 0o440
    (item,) = secret["items"]
    assert item["key"] == "keys.txt"
    assert env(worker)["ORPHEUS_API_KEYS_FILE"] == f"{keys_mount['mountPath']}/{item['path']}"
    llm_pod = LlmServerConfig.from_cli([], _pod_env(worker, "ORPHEUS_"))
    assert llm_pod.api_keys_file == env(worker)["ORPHEUS_API_KEYS_FILE"]
    assert volume(snac(objects), "api-keys") is None and "apiKeys" not in json.dumps(snac(objects))
    assert not any(o["kind"] == "Secret" and o["metadata"]["name"] == "orpheus-api-keys" for o in objects)
    for render in RENDERS:  # off by default
        assert volume(llm(RENDERS[render]()), "api-keys") is None
        assert "ORPHEUS_API_KEYS_FILE" not in env(llm(RENDERS[render]()))


def test_pods_restart_on_certificate_changes_only_when_asked() -> None:
    """The servers re-read their files, so by default nothing rolls the pods when certificates
    change; codecTls.restartOnChange adds a checksum of the generated Secret to both pod templates."""
    for render in RENDERS:
        for deployment in (llm(RENDERS[render]()), snac(RENDERS[render]())):
            assert "annotations" not in deployment["spec"]["template"]["metadata"]
    objects = rendered("helm-h100-api-keys")
    checksums = {d["spec"]["template"]["metadata"]["annotations"]["checksum/codec-tls"] for d in (llm(objects), snac(objects))}
    (checksum,) = checksums
    assert re.fullmatch(r"[0-9a-f]{64}", checksum)


def test_no_secret_mount_uses_sub_path() -> None:
    """kubelet updates Secret volumes in place only without subPath: rotation depends on it."""
    for name in VALIDATED:
        for deployment in (o for o in rendered(name) if o["kind"] == "Deployment"):
            for c in pod_spec(deployment)["containers"] + pod_spec(deployment).get("initContainers", []):
                assert not any("subPath" in m or "subPathExpr" in m for m in c.get("volumeMounts", [])), name


# ---------------------------------------------------------------- hardening


WRITABLE_VOLUME_KINDS = {"emptyDir", "persistentVolumeClaim"}


@pytest.mark.parametrize("name", VALIDATED)
def test_every_container_is_hardened(name: str) -> None:
    """Every container of every pod (init containers included): non-root, no privilege escalation,
    no capabilities, seccomp RuntimeDefault, read-only root; only emptyDir and claims writable."""
    deployments = [o for o in rendered(name) if o["kind"] == "Deployment"]
    assert len(deployments) == 3  # workers, codec replicas, front
    for deployment in deployments:
        spec = pod_spec(deployment)
        assert spec["automountServiceAccountToken"] is False
        assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC", "shareProcessNamespace"))
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert not any("hostPath" in v for v in volumes.values())
        pod_context = spec["securityContext"]
        for c in spec["containers"] + spec.get("initContainers", []) + spec.get("ephemeralContainers", []):
            context = {**pod_context, **c.get("securityContext", {})}  # container settings win
            where = f"{name}: {deployment['metadata']['name']}/{c['name']}"
            assert context.get("runAsNonRoot") is True, where
            assert context.get("runAsUser", 0) != 0 and context.get("runAsGroup", 0) != 0, where
            assert context.get("allowPrivilegeEscalation") is False, where
            assert context.get("privileged", False) is False, where
            assert context.get("capabilities", {}).get("drop") == ["ALL"], where
            assert not context.get("capabilities", {}).get("add"), where
            assert context.get("seccompProfile") == {"type": "RuntimeDefault"}, where
            assert context.get("readOnlyRootFilesystem") is True, where
            for m in c.get("volumeMounts", []):
                kind = next(k for k in volumes[m["name"]] if k != "name")
                if not m.get("readOnly"):
                    assert kind in WRITABLE_VOLUME_KINDS, f"{where}: {m['mountPath']} writable on a {kind}"
                if kind in ("secret", "configMap", "projected"):
                    assert m.get("readOnly") is True, f"{where}: {m['mountPath']}"
            assert {m["mountPath"] for m in c.get("volumeMounts", []) if not m.get("readOnly")} >= {"/tmp"}


def _walk(node: object, path: str = ""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield f"{path}.{key}", key, value
            yield from _walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}[{i}]")


@pytest.mark.parametrize("name", VALIDATED)
def test_nothing_in_the_rendered_objects_runs_as_root(name: str) -> None:
    for obj in rendered(name):
        for path, key, value in _walk(obj):
            where = f"{obj['kind']}/{obj['metadata']['name']}{path}"
            assert not (key in ("runAsUser", "runAsGroup", "fsGroup") and value == 0), where
            assert not (key == "runAsNonRoot" and value is not True), where
            assert not (key in ("privileged", "allowPrivilegeEscalation", "hostNetwork", "hostPID") and value is True), where
            assert key != "hostPath" and not path.endswith("capabilities.add"), where


# ---------------------------------------------------------------- kustomize agrees with Helm


@cache
def _load_tool(name: str):
    """A script of deploy/tools/ as a module (it is no package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "deploy" / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_kustomize_base_is_generated_from_the_current_chart() -> None:
    render_k8s = _load_tool("render_k8s")
    assert render_k8s.stale(KUSTOMIZE / "base", render_k8s.base_files()) == [], "run python deploy/tools/render_k8s.py"


def _comparable(objects: list[dict]) -> dict:
    """Objects by (kind, name), without what only one renderer adds (Helm's labels and
    annotations, the overlay's Namespace); env lists as maps, since only values matter."""
    render_k8s = _load_tool("render_k8s")
    out = {}
    for obj in objects:
        if obj["kind"] == "Namespace":
            continue
        obj = render_k8s.strip_helm(json.loads(json.dumps(obj)))
        for c in obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            c["env"] = {e["name"]: e for e in c["env"]}
        out[(obj["kind"], obj["metadata"]["name"])] = obj
    return out


@pytest.mark.parametrize("profile", ["h100", "cpu"])
def test_kustomize_overlay_equals_the_helm_profile(profile: str) -> None:
    # k8s/base mounts an existing Secret (render_k8s.BASE_VALUES) where Helm would generate one.
    helm_objects = _comparable(helm_render(profile, _load_tool("render_k8s").BASE_VALUES))
    kustomize_objects = _comparable(kustomize_render(profile))
    assert sorted(helm_objects) == sorted(kustomize_objects)
    for key, obj in helm_objects.items():
        assert kustomize_objects[key] == obj, f"{key} differs between helm and kustomize ({profile})"
    namespaces = [o for o in kustomize_render(profile) if o["kind"] == "Namespace"]
    assert [n["metadata"]["name"] for n in namespaces] == [NAMESPACE]
    namespaced = [o for o in kustomize_render(profile) if o["kind"] != "Namespace"]
    assert {o["metadata"].get("namespace") for o in namespaced} == {NAMESPACE}


# ---------------------------------------------------------------- node prerequisites (deploy/cluster)


def test_mig_layout_gives_the_snac_replicas_their_instances_on_the_8th_gpu() -> None:
    config_map = yaml.safe_load((REPO / "deploy" / "cluster" / "mig-parted-config.yaml").read_text())
    kubernetes_validate.validate(config_map, KUBE_VERSIONS[-1], strict=True)
    layout = yaml.safe_load(config_map["data"]["config.yaml"])["mig-configs"]["megapod-h100"]
    whole = [d for d in layout if not d["mig-enabled"]]
    (sliced,) = [d for d in layout if d["mig-enabled"]]
    assert sorted(i for d in whole for i in d["devices"]) == list(range(7)) and sliced["devices"] == [7]
    mig_resource = H100.snac_accelerator
    assert sliced["mig-devices"] == {mig_resource.removeprefix(MIG): H100.megapod.replicas}
    assert mig_resource in limits(snac(helm_render("h100")))
    operator = yaml.safe_load((REPO / "deploy" / "cluster" / "gpu-operator-values.yaml").read_text())
    assert operator["mig"]["strategy"] == "mixed"  # whole GPUs stay nvidia.com/gpu
    assert operator["migManager"]["config"]["name"] == config_map["metadata"]["name"]


def test_node_label_script_sets_the_charts_node_selector() -> None:
    script = (REPO / "deploy" / "cluster" / "label-node.sh").read_text()
    ((key, value),) = llm(helm_render("h100"))["spec"]["template"]["spec"]["nodeSelector"].items()
    assert f"{key}={value}" in script and "nvidia.com/mig.config=" in script
    assert re.search(r"mig_config=\$\{2:-megapod-h100\}", script)


def test_dra_alternative_validates_and_patches_the_snac_deployment(tmp_path: Path) -> None:
    alternatives = REPO / "deploy" / "cluster" / "alternatives"
    claim = yaml.safe_load((alternatives / "dra-shared-gpu.yaml").read_text())
    kubernetes_validate.validate(claim, "1.34.0", strict=True)  # resource.k8s.io/v1 is GA from 1.34
    shutil.copy(alternatives / "dra-snac-patch.yaml", tmp_path / "patch.yaml")
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(KUSTOMIZE / "base", tmp_path)], "patches": [{"path": "patch.yaml"}]}))
    done = run(kubectl(), "kustomize", str(tmp_path))
    assert done.returncode == 0, done.stderr
    deployment = snac(parse_manifests(done.stdout))
    kubernetes_validate.validate(deployment, KUBE_VERSIONS[-1], strict=True)
    assert deployment["spec"]["template"]["spec"]["resourceClaims"][0]["resourceClaimName"] == claim["metadata"]["name"]
    assert container(deployment)["resources"]["claims"] == [{"name": "gpu"}]


# ---------------------------------------------------------------- the GPU profiles' engines, as vLLM 0.33 builds them
# The CUDA image's vLLM (deploy/docker/cuda-pins.txt) must take the H100 profiles' engine settings as the pods get them
# (issue 25): tests/engine_config_probe.py builds that release's own config objects from them through the worker's own
# engine_args(), with the release's Python files first on the path (deploy/tools/fetch_vllm_gpu.py; `make test`
# fetches them into .vllm-gpu).

VLLM_GPU = REPO / ".vllm-gpu"
GPU_PROFILES = ("h100", "h100-fp8")


@pytest.fixture(scope="module")
def resolved(tmp_path_factory) -> dict[str, dict]:
    """Each GPU profile's worker settings through vLLM 0.33's configs, plus the fp8 profile with an e5m2 KV cache."""
    assert (VLLM_GPU / "vllm").is_dir(), "`make test` fetches vLLM's CUDA release into .vllm-gpu"
    model_dir = tmp_path_factory.mktemp("orpheus-3b-architecture")
    shutil.copy(ORPHEUS_3B_CONFIG, model_dir / "config.json")
    cases = {name: LlmServerConfig.from_cli([], _pod_env(llm(helm_render(name)), "ORPHEUS_")) for name in GPU_PROFILES}
    cases["h100-fp8-e5m2"] = cases["h100-fp8"].replace(kv_cache_dtype="fp8_e5m2")
    settings = [json.loads(c.model_dump_json()) for c in cases.values()]
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("engine_config_probe.py")), json.dumps(settings),
                           str(model_dir)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": f"{VLLM_GPU}{os.pathsep}{REPO}"})
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(zip(cases, json.loads(done.stdout.splitlines()[-1])))


@cache
def longest_prompt() -> int:
    """Tokens of the longest prompt one segment makes: the most characters a segment holds, in words, with each
    voice. The tiny checkpoint's own tokenizer makes a token of every character (292 for 280 characters), more than
    Orpheus's Llama 3 tokenizer makes of English words, so what fits here fits there."""
    from transformers import AutoTokenizer

    config = LlmServerConfig()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("tiny", config.cache_dir))
    text = ("Thanks for calling, how can I help you today? " * 20)[: config.max_segment_chars]
    return max(len(prompt_ids(tokenizer, voice, text)) for voice in config.voices)


@pytest.mark.parametrize("profile", GPU_PROFILES)
def test_the_profile_is_vllm_0_33s_to_take(resolved, profile):
    got = resolved[profile]
    assert "error" not in got, got
    pinned = _load_tool("fetch_vllm_gpu").pinned_vllm()  # vllm==X.Y.Z
    assert got["vllm"] == pinned.split("==")[1] and got["platform"] == "HopperStandIn"


@pytest.mark.parametrize("profile", GPU_PROFILES)
def test_h100_engines_run_at_full_tilt(resolved, profile):
    got = resolved[profile]
    assert got["max_num_seqs"] >= 512
    # every batch the profile may admit replays a CUDA Graph (vLLM's own default stops at 512), and so does every
    # step it schedules: a step over the largest captured size runs eager (config/vllm.py, _set_cudagraph_sizes),
    # and at 400-512 streams nearly every step is the full batch's decodes beside a new prompt's chunk (issue 44)
    assert got["max_cudagraph_capture_size"] >= got["max_num_seqs"]
    assert got["max_cudagraph_capture_size"] >= got["max_num_batched_tokens"]
    # a new stream's whole prompt fits one step beside a full batch of decodes: chunked prefill never needs
    # to split an Orpheus prompt, and no prompt waits for the step budget
    assert got["chunked_prefill"] and got["max_num_batched_tokens"] >= got["max_num_seqs"] + longest_prompt()
    assert got["prefix_caching"]  # every request of a voice starts with the same prompt prefix
    # asked for explicitly, so VllmConfig raises where 0.33 cannot run it (some speculative methods, pipeline
    # parallelism on the V1 runner, ROCm DeepEP DBO); the logits processors sit in ModelConfig, not built here
    # and not among those checks
    assert got["async_scheduling"] is True and got["scheduler"] == "AsyncScheduler"
    assert got["logits_processors"] == ["FrameConstraintV1"]  # what engine_args hands vLLM's V1 runner
    assert got["attention_backend"].endswith("FLASHINFER") and got["trtllm_attention"] is True


@pytest.mark.parametrize("profile", GPU_PROFILES)
def test_the_first_start_compiles_no_flashinfer_sampler(resolved, profile):
    """Model Runner V2 warms its sampler with unseeded top-k/top-p requests, which FlashInfer's fused sampler would
    take, compiling its kernels at start (or failing) where none are precompiled (issue 44, finding 1); the worker
    turns it off on CUDA (every request of ours is seeded, which that sampler never serves)."""
    assert resolved[profile]["flashinfer_sampler"] is False


@pytest.mark.parametrize("profile", GPU_PROFILES)
def test_the_v1_runner_forced_on_cuda_is_warned_of(resolved, profile):
    """Model Runner V2 is the CUDA default and draws every seeded row's noise in one kernel; forced back to V1, the
    sampler launches one per seeded row each step, and every stream of ours is seeded (issue 44, item 6)."""
    warned = resolved[profile]["v1_runner_warning"]
    assert warned["default"] is None
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in warned["forced"] and "per seeded stream" in warned["forced"]


def test_h100_is_bf16_and_h100_fp8_quantizes_weights_and_kv_cache_as_they_load(resolved):
    bf16, fp8 = resolved["h100"], resolved["h100-fp8"]
    assert (bf16["quantization"], bf16["kv_cache_dtype"]) == (None, "auto")
    # fp8_per_tensor: one of 0.33's online shorthands, quantizing the bf16 checkpoint's weights as they load
    assert fp8["quantization"] == "fp8_per_tensor" and fp8["quantization_known"] and fp8["quantization_online"]
    assert fp8["kv_cache_dtype"] == "fp8"  # e4m3, the format TRT-LLM attention reads


def test_an_e5m2_kv_cache_under_trtllm_attention_is_refused_before_vllm_starts(resolved):
    assert "reads fp8 KV caches as e4m3 only" in resolved["h100-fp8-e5m2"]["error"]

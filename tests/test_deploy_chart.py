"""The Kubernetes MegaPod as rendered: Helm chart (both profiles), kustomize overlays, cluster files.

Every check runs the real renderers (`helm template`, `kubectl kustomize`) and reads the objects
they produce; no cluster is needed. Helm and kubectl come from `make install` (deploy/tools/install_k8s_tools.py):
a missing helm or kubectl fails these tests instead of skipping them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import typing
from functools import cache
from pathlib import Path

import kubernetes.client as k8s
import kubernetes_validate
import pytest
import yaml

from llm_server.api import create_app
from llm_server.codec_client import channel_target
from llm_server.config import LlmServerConfig
from llm_server.metrics import LlmMetrics
from megapod.cluster import CPU, H100, MIG_INSTANCES_PER_GPU, PROFILES, ClusterProfile
from megapod.deploy import CUSTOM_PLURALS, TYPED_KINDS, client_model
from megapod.render import (
    CHART, KUBE_VERSION, KUSTOMIZE, REPO, HelmRender, RenderError, chart_values, find_helm, find_kubectl,
    parse_manifests,
)
from megapod.topology import MegaPodConfig
from snac_server.api import codec_pb2
from snac_server.config import SnacServerConfig, config_from_args

# Kubernetes versions every object is validated against: the oldest the chart supports
# (Chart.yaml kubeVersion) and the newest kubernetes-validate 1.37.0 has schemas for.
KUBE_VERSIONS = (KUBE_VERSION, "1.37.0")
RELEASE = NAMESPACE = "orpheus-megapod"
CODEC_SERVICE = codec_pb2.DESCRIPTOR.services_by_name["SnacCodec"].full_name
GPU, MIG = "nvidia.com/gpu", "nvidia.com/mig-"
OPTIONAL_FEATURES = (
    "serviceMonitor.enabled=true", "llm.autoscaling.enabled=true", "ingress.enabled=true",
    "ingress.host=tts.example.com", "service.type=LoadBalancer",
    "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.name=monitoring",
)


# ---------------------------------------------------------------- rendering


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
    "helm-cpu": lambda: helm_render("cpu"),
    "kustomize-cpu": lambda: kustomize_render("cpu"),
}
GPU_RENDERS = ("helm-h100", "kustomize-h100")
CPU_RENDERS = ("helm-cpu", "kustomize-cpu")


def profile_of(render: str) -> ClusterProfile:
    return PROFILES[render.split("-")[1]]


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


@pytest.mark.parametrize("profile", ["h100", "cpu"])
def test_helm_lint_passes_strict(profile: str) -> None:
    argv = [helm(), "lint", "--strict", str(CHART)]
    if profile != "h100":
        argv += ["-f", str(CHART / PROFILES[profile].values_file)]
    done = run(*argv)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout


VALIDATED = [*RENDERS, "helm-h100-optional", "helm-cpu-optional", "helm-pvc-model"]


def rendered(name: str) -> list[dict]:
    if name == "helm-pvc-model":
        return helm_render("h100", ("llm.model.source=pvc", "llm.model.pvc.claimName=orpheus-weights"))
    if name.endswith("-optional"):
        return helm_render(name.split("-")[1], OPTIONAL_FEATURES)
    return RENDERS[name]()


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("name", VALIDATED)
def test_every_object_validates_against_the_kubernetes_schemas(name: str, version: str) -> None:
    objects = rendered(name)
    custom = [o for o in objects if (o["apiVersion"], o["kind"]) in CUSTOM_PLURALS]
    for obj in objects:
        if obj not in custom:  # strict: an unknown field anywhere fails
            kubernetes_validate.validate(obj, version, strict=True)
    # kubernetes-validate has no schema for CRD kinds; test_service_monitor asserts on them.
    assert all(o["kind"] == "ServiceMonitor" for o in custom)
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


def test_schema_refuses_unknown_server_settings() -> None:
    done = run(helm(), "template", RELEASE, str(CHART), "--set", "snac.server.maxBatchSize=64")
    assert done.returncode != 0
    assert "maxBatchSize" in done.stderr


def _camel(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(part.capitalize() for part in rest)


def _json_type(hint: object) -> str:
    if typing.get_origin(hint) is tuple:
        return "array"
    return {bool: "boolean", int: "integer", float: "number", str: "string"}[hint]  # type: ignore[index]


@pytest.mark.parametrize(
    "tier, cls, set_elsewhere",
    [("snac", SnacServerConfig, {"host"}), ("llm", LlmServerConfig, {"host", "model", "snac", "cache_dir"})],
)
def test_schema_server_settings_are_exactly_the_config_fields(tier: str, cls: type, set_elsewhere: set) -> None:
    """Helm values map one-to-one onto the tier's config dataclass, with the dataclass's types."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    properties = schema["properties"][tier]["properties"]["server"]["properties"]
    hints = typing.get_type_hints(cls)
    fields = {_camel(f.name): _json_type(hints[f.name]) for f in dataclasses.fields(cls) if f.name not in set_elsewhere}
    assert {name: p["type"] for name, p in properties.items()} == fields


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


def _leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@pytest.mark.parametrize("profile", [H100, CPU], ids=lambda p: p.name)
def test_chart_values_files_are_the_cluster_profiles(profile: ClusterProfile) -> None:
    """values.yaml (+ values-cpu.yaml) hold exactly what megapod/cluster.py derives from MegaPodConfig."""
    values = _leaves(_merged_values(profile))
    for key, expected in _leaves(chart_values(profile)).items():
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


@pytest.mark.parametrize("profile", ["h100", "cpu"])
def test_megapod_deploy_values_render_the_charts_defaults(profile: str) -> None:
    """What `megapod deploy` renders (values from MegaPodConfig) equals the chart's own defaults."""
    assert parse_manifests(HelmRender(PROFILES[profile]).run(helm())) == helm_render(profile)


def test_megapod_config_changes_reach_the_pods() -> None:
    pod = dataclasses.replace(H100.megapod, workers=5, snac_max_batch=64, codec_policy="exact", grace_s=90.0)
    objects = parse_manifests(HelmRender(dataclasses.replace(H100, megapod=pod)).run(helm()))
    assert llm(objects)["spec"]["replicas"] == 5
    assert env(snac(objects))["SNAC_MAX_BATCH"] == "64"
    assert env(snac(objects))["SNAC_POLICY"] == env(llm(objects))["ORPHEUS_CODEC_POLICY"] == "exact"
    assert llm(objects)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 90


def _pod_env(deployment: dict, prefix: str) -> dict[str, str]:
    values = {k: v for k, v in env(deployment).items() if k.startswith(prefix)}
    return {k: v.replace("$(POD_NAMESPACE)", NAMESPACE) for k, v in values.items()}


@pytest.mark.parametrize("render", list(RENDERS))
def test_pods_run_the_same_servers_as_megapod_up(render: str) -> None:
    """The pods' variables, parsed by the servers' own config loaders, equal the configs the local
    launcher builds from the same MegaPodConfig (MegaPodConfig.snac_args / worker_args), except the
    addresses that differ between one machine and a cluster."""
    objects, pod = RENDERS[render](), profile_of(render).megapod
    snac_pod = config_from_args(SnacServerConfig, [], _pod_env(snac(objects), "SNAC_"), "SNAC_", "snac-server")
    snac_local = config_from_args(SnacServerConfig, pod.snac_args(0), {}, "SNAC_", "snac-server")
    assert dataclasses.replace(snac_pod, host=snac_local.host) == snac_local
    llm_pod = config_from_args(LlmServerConfig, [], _pod_env(llm(objects), "ORPHEUS_"), "ORPHEUS_", "llm-server")
    llm_local = config_from_args(LlmServerConfig, pod.worker_args(0), {}, "ORPHEUS_", "llm-server")
    differ = {"host", "port", "snac", "cache_dir"}
    same = {f.name for f in dataclasses.fields(LlmServerConfig)} - differ
    assert {n: getattr(llm_pod, n) for n in same} == {n: getattr(llm_local, n) for n in same}
    assert (snac_pod.host, llm_pod.host) == ("0.0.0.0", "0.0.0.0")  # the servers' own default


# ---------------------------------------------------------------- topology


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
    grpc, metrics = port_named(codec, "grpc"), port_named(codec, "metrics")
    assert (grpc, metrics) == (SnacServerConfig().port, SnacServerConfig().metrics_port)
    assert (int(env(codec)["SNAC_PORT"]), int(env(codec)["SNAC_METRICS_PORT"])) == (grpc, metrics)
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container(codec)[probe]["grpc"]["port"] == grpc
    assert container(codec)["readinessProbe"]["grpc"]["service"] == CODEC_SERVICE


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
    assert service["spec"]["selector"] == llm(objects)["spec"]["selector"]["matchLabels"]
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


def test_service_monitor_scrapes_both_tiers() -> None:
    objects = helm_render("h100", OPTIONAL_FEATURES)
    (monitor,) = [o for o in objects if o["kind"] == "ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    services = [o for o in objects if o["kind"] == "Service"]
    assert all(matches(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"]) for s in services)
    ports = {p["name"] for s in services for p in s["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == {"http", "metrics"} <= ports
    assert {e["path"] for e in monitor["spec"]["endpoints"]} == {"/metrics"}
    assert not any(o["kind"] == "ServiceMonitor" for o in helm_render("h100"))  # optional


def test_autoscaling_on_active_streams() -> None:
    objects = helm_render("h100", OPTIONAL_FEATURES)
    hpa = find(objects, "HorizontalPodAutoscaler", f"{RELEASE}-llm")["spec"]
    assert hpa["scaleTargetRef"]["name"] == llm(objects)["metadata"]["name"]
    assert "replicas" not in llm(objects)["spec"]  # the autoscaler owns it
    assert hpa["maxReplicas"] <= H100.gpus_per_node - H100.snac_gpus()
    metric = hpa["metrics"][0]["pods"]["metric"]["name"]
    assert metric in {m.name for m in LlmMetrics(lambda: 0).registry.collect()}


def test_model_from_a_volume_claim() -> None:
    objects = helm_render("h100", ("llm.model.source=pvc", "llm.model.pvc.claimName=orpheus-weights"))
    worker = llm(objects)
    assert env(worker)["ORPHEUS_MODEL"] == "/models/orpheus-3b-0.1-ft" and env(worker)["HF_HUB_OFFLINE"] == "1"
    volume = next(v for v in worker["spec"]["template"]["spec"]["volumes"] if v["name"] == "models")
    assert volume["persistentVolumeClaim"] == {"claimName": "orpheus-weights", "readOnly": True}
    assert not any(o["kind"] == "PersistentVolumeClaim" for o in objects)
    done = run(helm(), "template", RELEASE, str(CHART), "--set", "llm.model.source=pvc")
    assert done.returncode != 0 and "claimName is required" in done.stderr


# ---------------------------------------------------------------- kustomize agrees with Helm


@cache
def _load_render_k8s():
    spec = importlib.util.spec_from_file_location("render_k8s", REPO / "deploy" / "tools" / "render_k8s.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_kustomize_base_is_generated_from_the_current_chart() -> None:
    render_k8s = _load_render_k8s()
    assert render_k8s.stale(KUSTOMIZE / "base", render_k8s.base_files()) == [], "run python deploy/tools/render_k8s.py"


def _comparable(objects: list[dict]) -> dict:
    """Objects by (kind, name), without what only one renderer adds (Helm's labels and
    annotations, the overlay's Namespace); env lists as maps, since only values matter."""
    render_k8s = _load_render_k8s()
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
    helm_objects, kustomize_objects = _comparable(helm_render(profile)), _comparable(kustomize_render(profile))
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

"""Apply the MegaPod's objects through the Kubernetes API, wait for the rollouts, report endpoints.

The API objects (CoreV1Api, AppsV1Api, ...) come in through `KubeApis`, so the logic runs
against the real client or against a test double that answers with the client's own models.
Each object is created; one that already exists (409) is server-side applied instead, which
takes over the fields this tool sets and leaves other managers' fields alone, except objects
annotated `orpheus-megapod/keep-existing: "true"` (the chart's Helm-generated TLS Secret): those are
created once and then kept, as Helm's own lookup keeps them, so a redeploy never swaps certificates.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import kubernetes.client as k8s
from kubernetes.client.exceptions import ApiException

FIELD_MANAGER = "megapod"
APPLY_PATCH = "application/apply-patch+yaml"
KEEP_EXISTING = "orpheus-megapod/keep-existing"
# Dependencies first: the namespace, what pods mount or run as, then the workloads.
APPLY_ORDER = (
    "Namespace", "ServiceAccount", "Secret", "Certificate", "ConfigMap", "PersistentVolumeClaim", "Service",
    "NetworkPolicy", "PodDisruptionBudget", "Deployment", "HorizontalPodAutoscaler", "Ingress",
    "ServiceMonitor", "PodMonitor", "PrometheusRule",
)
# (apiVersion, kind) -> (KubeApis attribute, method suffix of its create_/patch_ calls)
TYPED_KINDS = {
    ("v1", "Namespace"): ("core", "namespace"),
    ("v1", "ServiceAccount"): ("core", "service_account"),
    ("v1", "Secret"): ("core", "secret"),
    ("v1", "ConfigMap"): ("core", "config_map"),
    ("v1", "PersistentVolumeClaim"): ("core", "persistent_volume_claim"),
    ("v1", "Service"): ("core", "service"),
    ("networking.k8s.io/v1", "NetworkPolicy"): ("networking", "network_policy"),
    ("networking.k8s.io/v1", "Ingress"): ("networking", "ingress"),
    ("policy/v1", "PodDisruptionBudget"): ("policy", "pod_disruption_budget"),
    ("apps/v1", "Deployment"): ("apps", "deployment"),
    ("autoscaling/v2", "HorizontalPodAutoscaler"): ("autoscaling", "horizontal_pod_autoscaler"),
}
CUSTOM_PLURALS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitors",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitors",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrules",
    ("cert-manager.io/v1", "Certificate"): "certificates",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobjects",
}


class DeployError(RuntimeError):
    """The MegaPod could not be applied or did not become ready."""


@dataclass
class KubeApis:
    """The Kubernetes API groups `megapod deploy` talks to."""

    core: Any
    apps: Any
    policy: Any
    networking: Any
    autoscaling: Any
    custom: Any

    @classmethod
    def from_kubeconfig(cls, context: str | None = None) -> KubeApis:
        """The current kubeconfig context (or `context`); inside a pod, its service account."""
        from kubernetes import config

        try:
            config.load_kube_config(context=context)
        except config.ConfigException:
            try:
                config.load_incluster_config()
            except config.ConfigException as exc:
                raise DeployError(f"no cluster to talk to (no kubeconfig, not in a pod): {exc}") from exc
        api = k8s.ApiClient()
        return cls(k8s.CoreV1Api(api), k8s.AppsV1Api(api), k8s.PolicyV1Api(api),
                   k8s.NetworkingV1Api(api), k8s.AutoscalingV2Api(api), k8s.CustomObjectsApi(api))


def describe(obj: dict) -> str:
    return f"{obj['kind'].lower()}/{obj['metadata']['name']}"


def client_model(obj: dict) -> type:
    """The kubernetes client's model class of a typed object: apps/v1 Deployment -> V1Deployment."""
    return getattr(k8s, obj["apiVersion"].split("/")[-1].capitalize() + obj["kind"])


def apply_order(objects: Iterable[dict]) -> list[dict]:
    """Objects sorted so that each one's dependencies exist before it (stable within a kind)."""
    rank = {kind: i for i, kind in enumerate(APPLY_ORDER)}
    return sorted(objects, key=lambda o: rank.get(o["kind"], len(rank)))


def apply_object(apis: KubeApis, obj: dict, namespace: str) -> str:
    """Create `obj`, or server-side apply it when it exists; returns created/configured."""
    namespace = obj["metadata"].get("namespace", namespace)
    key = (obj["apiVersion"], obj["kind"])
    try:
        if key in CUSTOM_PLURALS:
            return _apply_custom(apis.custom, obj, namespace, CUSTOM_PLURALS[key])
        if key in TYPED_KINDS:
            return _apply_typed(apis, obj, namespace, *TYPED_KINDS[key])
    except ApiException as exc:
        raise DeployError(f"{describe(obj)}: the API server refused it ({exc.status} {exc.reason})") from exc
    raise DeployError(f"{describe(obj)}: {obj['apiVersion']} {obj['kind']} is not a kind megapod deploy applies")


def _apply_typed(apis: KubeApis, obj: dict, namespace: str, group: str, suffix: str) -> str:
    api = getattr(apis, group)
    scope = "" if obj["kind"] == "Namespace" else "namespaced_"
    where = () if obj["kind"] == "Namespace" else (namespace,)
    try:
        getattr(api, f"create_{scope}{suffix}")(*where, client_model(obj).from_dict(obj), field_manager=FIELD_MANAGER)
        return "created"
    except ApiException as exc:
        if exc.status != 409:  # 409 Conflict: it exists already
            raise
    if (obj["metadata"].get("annotations") or {}).get(KEEP_EXISTING) == "true":
        return "kept (exists)"
    getattr(api, f"patch_{scope}{suffix}")(
        obj["metadata"]["name"], *where, obj, field_manager=FIELD_MANAGER, force=True, _content_type=APPLY_PATCH
    )
    return "configured"


def _apply_custom(api: Any, obj: dict, namespace: str, plural: str) -> str:
    # Server-side apply creates or updates in one call: custom kinds have no typed model to build.
    group, version = obj["apiVersion"].split("/")
    api.patch_namespaced_custom_object(
        group, version, namespace, plural, obj["metadata"]["name"], obj,
        field_manager=FIELD_MANAGER, force=True, _content_type=APPLY_PATCH,
    )
    return "applied"


def apply_all(apis: KubeApis, objects: Sequence[dict], namespace: str, report: Callable[[str], None]) -> None:
    for obj in apply_order(objects):
        report(f"{describe(obj)} {apply_object(apis, obj, namespace)}")


@dataclass(frozen=True)
class Rollout:
    """Where one Deployment's rollout stands."""

    done: bool
    message: str


def rollout_status(deployment: k8s.V1Deployment) -> Rollout:
    """kubectl rollout status's rule: the new spec observed, every replica updated, no old
    replica left, every updated replica available (ready). Raises when the rollout is stuck."""
    status = deployment.status or k8s.V1DeploymentStatus()
    want = deployment.spec.replicas if deployment.spec.replicas is not None else 1
    if (deployment.metadata.generation or 0) > (status.observed_generation or 0):
        return Rollout(False, "waiting for the controller to observe the new spec")
    for condition in status.conditions or ():
        if condition.type == "Progressing" and condition.reason == "ProgressDeadlineExceeded":
            name = deployment.metadata.name
            raise DeployError(f"deployment/{name} exceeded its progress deadline: {condition.message}")
    updated, total, available = status.updated_replicas or 0, status.replicas or 0, status.available_replicas or 0
    if updated < want:
        return Rollout(False, f"{updated} of {want} replicas updated")
    if total > updated:
        return Rollout(False, f"{total - updated} old replica(s) still terminating")
    if available < updated:
        return Rollout(False, f"{available} of {updated} updated replicas ready")
    return Rollout(True, f"{available} of {want} replicas ready")


def wait_for_rollouts(
    apis: KubeApis,
    deployments: Sequence[tuple[str, str]],
    timeout_s: float,
    report: Callable[[str], None],
    poll_s: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Poll (namespace, name) Deployments until every rollout is done; DeployError after timeout_s
    naming each one still not ready and why."""
    deadline = clock() + timeout_s
    pending = dict.fromkeys(deployments, "")
    while True:
        for namespace, name in list(pending):
            state = rollout_status(apis.apps.read_namespaced_deployment_status(name, namespace))
            if state.message != pending[(namespace, name)]:
                report(f"deployment/{name}: {state.message}")
            if state.done:
                del pending[(namespace, name)]
            else:
                pending[(namespace, name)] = state.message
        if not pending:
            return
        if clock() >= deadline:
            waiting = "; ".join(f"deployment/{name} in {ns}: {msg}" for (ns, name), msg in pending.items())
            raise DeployError(f"not ready after {timeout_s:.0f} s: {waiting}")
        sleep(poll_s)


def deployments_of(objects: Iterable[dict], namespace: str) -> list[tuple[str, str]]:
    deployments = (o["metadata"] for o in objects if o["kind"] == "Deployment")
    return [(meta.get("namespace", namespace), meta["name"]) for meta in deployments]


def endpoints(apis: KubeApis, objects: Iterable[dict], namespace: str) -> list[str]:
    """One line per Service port: its in-cluster address (NAME.NAMESPACE.svc resolves under any
    cluster domain), and the load balancer's when it has one."""
    lines = []
    for obj in objects:
        if obj["kind"] != "Service":
            continue
        ns = obj["metadata"].get("namespace", namespace)
        service = apis.core.read_namespaced_service(obj["metadata"]["name"], ns)
        host = f"{service.metadata.name}.{ns}.svc"
        for port in service.spec.ports or ():
            lines.append(_endpoint_line(service, host, port))
    return lines


def _endpoint_line(service: k8s.V1Service, host: str, port: k8s.V1ServicePort) -> str:
    if port.name == "http":
        line = f"speech   http://{host}:{port.port}/v1/audio/speech"
        ingress = (service.status and service.status.load_balancer and service.status.load_balancer.ingress) or ()
        external = [f"http://{i.ip or i.hostname}:{port.port}" for i in ingress]
        return line + (f"   (load balancer: {', '.join(external)})" if external else "")
    if port.name == "grpc":
        return f"codec    dns:///{host}:{port.port}   (gRPC; only LLM workers may connect)"
    return f"{port.name or 'port':8} {host}:{port.port}"

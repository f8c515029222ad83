"""`megapod deploy`: apply-and-wait logic against a test double of the kubernetes client, and the
--dry-run command. No cluster: the double answers with the client's own model objects and checks
every call against the real API class's signature."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import kubernetes.client as k8s
import pytest
import yaml
from kubernetes.client.exceptions import ApiException
from pydantic import BaseModel

from megapod import cli, deploy_cli
from megapod.cluster import H100, ClusterProfile
from megapod.deploy import (
    APPLY_PATCH,
    FIELD_MANAGER,
    KEEP_EXISTING,
    DeployError,
    KubeApis,
    apply_all,
    apply_object,
    deployments_of,
    endpoints,
    rollout_status,
    wait_for_rollouts,
)

NS = "orpheus-megapod"


class KubeApiDouble:
    """Test double of one kubernetes API class (CoreV1Api, AppsV1Api, ...). Calls are recorded
    and must bind to the real method's signature; objects live in a dict shared by all doubles."""

    def __init__(self, real: type, store: dict, failures: dict, statuses: dict, log: list) -> None:
        self.real, self.store, self.failures, self.statuses, self.log = real, store, failures, statuses, log
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, method: str):
        real_method = getattr(self.real, method)  # AttributeError: the real client has no such call

        def call(*args, **kwargs):
            inspect.signature(real_method).bind(self, *args, **kwargs)
            self.calls.append((method, args, kwargs))
            self.log.append((method, args, kwargs))
            return getattr(self, "_" + method.split("_")[0])(method, args, kwargs)

        return call

    def _create(self, method: str, args: tuple, kwargs: dict):
        body = args[-1]
        assert isinstance(body, BaseModel), f"{method} got {type(body).__name__}, not a client model"
        key = (body.kind, body.metadata.name)
        if key in self.failures:
            raise self.failures[key]
        if key in self.store:
            raise ApiException(status=409, reason="Conflict")
        self.store[key] = body
        return body

    def _patch(self, method: str, args: tuple, kwargs: dict):
        body = args[-1] if "body" not in kwargs else kwargs["body"]
        self.store[(body["kind"], body["metadata"]["name"])] = body
        return body

    def _read(self, method: str, args: tuple, kwargs: dict):
        name = args[0]
        if method == "read_namespaced_deployment_status":
            script = self.statuses[name]
            return script.pop(0) if len(script) > 1 else script[0]
        return self.store[("Service", name)]


def make_apis(existing=(), failures=None, statuses=None) -> KubeApis:
    store = {(o.kind, o.metadata.name): o for o in existing}
    shared = (store, failures or {}, statuses or {}, [])
    return KubeApis(
        core=KubeApiDouble(k8s.CoreV1Api, *shared), apps=KubeApiDouble(k8s.AppsV1Api, *shared),
        policy=KubeApiDouble(k8s.PolicyV1Api, *shared), networking=KubeApiDouble(k8s.NetworkingV1Api, *shared),
        autoscaling=KubeApiDouble(k8s.AutoscalingV2Api, *shared), custom=KubeApiDouble(k8s.CustomObjectsApi, *shared),
    )


def all_calls(apis: KubeApis) -> list[tuple[str, tuple, dict]]:
    """Every call to any of the doubles, in the order made."""
    return apis.core.log


def deployment(name: str, want: int, generation: int = 2, observed: int = 2, updated: int | None = None,
               total: int | None = None, available: int | None = None, conditions=None) -> k8s.V1Deployment:
    """A Deployment as the API server reports it, as the client's own model."""
    return k8s.V1Deployment(
        metadata=k8s.V1ObjectMeta(name=name, namespace=NS, generation=generation),
        spec=k8s.V1DeploymentSpec(
            replicas=want, selector=k8s.V1LabelSelector(match_labels={"app": name}),
            template=k8s.V1PodTemplateSpec(spec=k8s.V1PodSpec(containers=[k8s.V1Container(name="c", image="i")])),
        ),
        status=k8s.V1DeploymentStatus(observed_generation=observed, updated_replicas=updated, replicas=total,
                                      available_replicas=available, ready_replicas=available, conditions=conditions),
    )


def ready(name: str, want: int) -> k8s.V1Deployment:
    return deployment(name, want, updated=want, total=want, available=want)


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    """What `megapod deploy --profile h100` would apply (helm template through megapod.render)."""
    args = deploy_cli.build_parser().parse_args(["--profile", "h100"])
    return deploy_cli.render_objects(args, deploy_cli.profile_from_args(args))


# ---------------------------------------------------------------- apply


def test_new_objects_are_created_as_client_models_in_dependency_order(objects: list[dict]) -> None:
    apis, report = make_apis(), []
    apply_all(apis, objects, NS, report.append)
    creates = [c for c in all_calls(apis) if c[0].startswith("create_")]
    assert len(creates) == len(objects) and not [c for c in all_calls(apis) if c[0].startswith("patch_")]
    kinds = [c[1][-1].kind for c in creates]
    assert kinds[0] == "Namespace" and kinds[-2:] == ["Deployment", "Deployment"]
    assert kinds.index("ServiceAccount") < kinds.index("PersistentVolumeClaim") < kinds.index("Deployment")
    deployment_body = apis.core.store[("Deployment", "orpheus-megapod-llm")]
    assert isinstance(deployment_body, k8s.V1Deployment) and deployment_body.spec.replicas == 7
    assert all(c[2]["field_manager"] == FIELD_MANAGER for c in creates)
    assert report[0] == "namespace/orpheus-megapod created" and len(report) == len(objects)


def test_an_existing_object_is_server_side_applied(objects: list[dict]) -> None:
    llm = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-llm"))
    existing = k8s.V1Deployment.from_dict(llm)
    apis = make_apis(existing=[existing])
    assert apply_object(apis, llm, NS) == "configured"
    create, patch = apis.apps.calls
    assert create[0] == "create_namespaced_deployment"
    assert patch[0] == "patch_namespaced_deployment" and patch[1][:2] == ("orpheus-megapod-llm", NS)
    assert patch[1][2] is llm
    assert patch[2] == {"field_manager": FIELD_MANAGER, "force": True, "_content_type": APPLY_PATCH}


def test_other_api_errors_name_the_object(objects: list[dict]) -> None:
    refused = ApiException(status=403, reason="Forbidden")
    apis = make_apis(failures={("PodDisruptionBudget", "orpheus-megapod-snac"): refused})
    with pytest.raises(DeployError, match=r"poddisruptionbudget/orpheus-megapod-snac: .*403 Forbidden"):
        apply_all(apis, objects, NS, lambda _: None)
    assert not [c for c in all_calls(apis) if c[0] == "patch_namespaced_pod_disruption_budget"]


def test_custom_kinds_go_through_the_custom_objects_api() -> None:
    monitor = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
               "metadata": {"name": "orpheus-megapod", "namespace": NS}, "spec": {"endpoints": []}}
    apis = make_apis()
    assert apply_object(apis, monitor, "elsewhere") == "applied"
    ((method, args, kwargs),) = apis.custom.calls
    assert method == "patch_namespaced_custom_object"
    assert args[:5] == ("monitoring.coreos.com", "v1", NS, "servicemonitors", "orpheus-megapod")
    assert kwargs["_content_type"] == APPLY_PATCH and kwargs["force"] is True


def test_generated_tls_secret_is_created_once_then_kept(objects: list[dict]) -> None:
    """Helm-generated certificates differ on every render: redeploying must not replace the
    Secret the pods already trust (the chart marks it keep-existing); other objects are applied."""
    (secret,) = [o for o in objects if o["kind"] == "Secret"]
    assert secret["metadata"]["annotations"][KEEP_EXISTING] == "true"
    apis = make_apis()
    assert apply_object(apis, secret, NS) == "created"
    fresh = json.loads(json.dumps(secret))
    fresh["data"]["ca.crt"] = "bmV3"
    assert apply_object(apis, fresh, NS) == "kept (exists)"
    assert [c[0] for c in apis.core.calls] == ["create_namespaced_secret", "create_namespaced_secret"]
    assert apis.core.store[("Secret", secret["metadata"]["name"])].data == secret["data"]
    unmarked = {**fresh, "metadata": {**fresh["metadata"], "annotations": {}}}
    assert apply_object(apis, unmarked, NS) == "configured"  # any other Secret is applied as usual


def test_cert_manager_certificates_go_through_the_custom_objects_api() -> None:
    args = deploy_cli.build_parser().parse_args([
        "--set", "codecTls.certManager.enabled=true", "--set", "codecTls.certManager.issuerRef.name=ca"])
    rendered = deploy_cli.render_objects(args, deploy_cli.profile_from_args(args))
    certificates = [o for o in rendered if o["kind"] == "Certificate"]
    assert len(certificates) == 2 and not [o for o in rendered if o["kind"] == "Secret"]
    apis = make_apis()
    apply_all(apis, rendered, NS, lambda _: None)
    applied = [c for c in all_calls(apis) if c[0] == "patch_namespaced_custom_object"]
    assert [c[1][:4] for c in applied] == [("cert-manager.io", "v1", NS, "certificates")] * 2
    order = [c[0] for c in all_calls(apis) if c[0].startswith(("create_", "patch_"))]
    assert order.index("patch_namespaced_custom_object") < order.index("create_namespaced_deployment")


def test_unknown_kinds_are_refused() -> None:
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}}
    with pytest.raises(DeployError, match="job/x: batch/v1 Job is not a kind"):
        apply_object(make_apis(), job, NS)


# ---------------------------------------------------------------- rollout and readiness


@pytest.mark.parametrize("state, done, message", [
    (deployment("d", 7, generation=3, observed=2), False, "observe the new spec"),
    (deployment("d", 7, updated=5, total=7, available=5), False, "5 of 7 replicas updated"),
    (deployment("d", 7, updated=7, total=8, available=6), False, "1 old replica(s) still terminating"),
    (deployment("d", 7, updated=7, total=7, available=6), False, "6 of 7 updated replicas ready"),
    (ready("d", 7), True, "7 of 7 replicas ready"),
])
def test_rollout_status(state: k8s.V1Deployment, done: bool, message: str) -> None:
    status = rollout_status(state)
    assert status.done is done and message in status.message


def test_a_stuck_rollout_fails_at_once() -> None:
    stuck = k8s.V1DeploymentCondition(type="Progressing", status="False", reason="ProgressDeadlineExceeded",
                                      message="ReplicaSet has timed out progressing.")
    with pytest.raises(DeployError, match="deployment/d exceeded its progress deadline: ReplicaSet has timed out"):
        rollout_status(deployment("d", 7, updated=3, total=7, available=3, conditions=[stuck]))


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_waits_until_every_rollout_is_ready() -> None:
    statuses = {
        "snac": [deployment("snac", 3, updated=3, total=3, available=1), ready("snac", 3)],
        "llm": [deployment("llm", 7, updated=2, total=7, available=0),
                deployment("llm", 7, updated=7, total=7, available=6), ready("llm", 7)],
    }
    apis, clock, report = make_apis(statuses=statuses), FakeClock(), []
    wait_for_rollouts(apis, [(NS, "snac"), (NS, "llm")], 600, report.append, poll_s=5, clock=clock, sleep=clock.sleep)
    assert report == [
        "deployment/snac: 1 of 3 updated replicas ready", "deployment/llm: 2 of 7 replicas updated",
        "deployment/snac: 3 of 3 replicas ready", "deployment/llm: 6 of 7 updated replicas ready",
        "deployment/llm: 7 of 7 replicas ready",
    ]
    assert clock.now == 10  # two polls waited
    assert [c[1] for c in apis.apps.calls] == [("snac", NS), ("llm", NS), ("snac", NS), ("llm", NS), ("llm", NS)]


def test_timeout_names_the_workload_that_is_not_ready() -> None:
    statuses = {"snac": [ready("snac", 3)], "llm": [deployment("llm", 7, updated=7, total=7, available=4)]}
    clock = FakeClock()
    with pytest.raises(DeployError) as failure:
        wait_for_rollouts(make_apis(statuses=statuses), [(NS, "snac"), (NS, "llm")], 60, lambda _: None,
                          poll_s=5, clock=clock, sleep=clock.sleep)
    assert str(failure.value) == f"not ready after 60 s: deployment/llm in {NS}: 4 of 7 updated replicas ready"
    assert clock.now == 60


def test_endpoints_name_the_speech_url_and_the_load_balancer(objects: list[dict]) -> None:
    apis = make_apis()
    apply_all(apis, objects, NS, lambda _: None)
    front = apis.core.store[("Service", "orpheus-megapod")]
    balancer = k8s.V1LoadBalancerStatus(ingress=[k8s.V1LoadBalancerIngress(ip="203.0.113.7")])
    front.status = k8s.V1ServiceStatus(load_balancer=balancer)
    lines = endpoints(apis, objects, NS)
    assert lines[0] == ("speech   http://orpheus-megapod.orpheus-megapod.svc:8000/v1/audio/speech"
                        "   (load balancer: http://203.0.113.7:8000)")  # the front
    assert [line for line in lines if "/v1/audio/speech" in line] == lines[:1]  # workers only behind it
    assert "worker   orpheus-megapod-llm.orpheus-megapod.svc:8000" in lines
    assert any("codec    dns:///orpheus-megapod-snac.orpheus-megapod.svc:50051" in line for line in lines)
    assert "metrics  orpheus-megapod-snac.orpheus-megapod.svc:9091" in lines


def test_deploy_applies_waits_and_prints_endpoints(objects: list[dict], capsys: pytest.CaptureFixture) -> None:
    statuses = {"orpheus-megapod-llm": [ready("orpheus-megapod-llm", 7)],
                "orpheus-megapod-snac": [ready("orpheus-megapod-snac", 3)],
                "orpheus-megapod-front": [ready("orpheus-megapod-front", 2)]}
    apis = make_apis(statuses=statuses)
    args = deploy_cli.build_parser().parse_args([])
    deploy_cli.deploy(apis, objects, args)
    out = capsys.readouterr()
    assert "MegaPod ready:" in out.out and "/v1/audio/speech" in out.out
    assert "deployment/orpheus-megapod-llm: 7 of 7 replicas ready" in out.err
    assert sorted(deployments_of(objects, NS)) == [(NS, f"orpheus-megapod-{t}") for t in ("front", "llm", "snac")]


# ---------------------------------------------------------------- the command


@pytest.fixture
def no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object) -> KubeApis:
        raise AssertionError("--dry-run must not talk to a cluster")

    monkeypatch.setattr(KubeApis, "from_kubeconfig", classmethod(refuse))


def test_dry_run_prints_the_objects_it_would_apply(capsys: pytest.CaptureFixture, no_cluster: None) -> None:
    cli.main(["deploy", "--dry-run", "--profile", "cpu", "--namespace", "tts", "--workers", "3"])
    out = capsys.readouterr()
    printed = [o for o in yaml.safe_load_all(out.out) if o]
    assert printed[0] == {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "tts"}}
    llm = next(o for o in printed if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-llm"))
    assert llm["metadata"]["namespace"] == "tts" and llm["spec"]["replicas"] == 3
    assert f"would apply {len(printed)} objects" in out.err


def test_dry_run_of_a_kustomize_overlay(capsys: pytest.CaptureFixture, no_cluster: None) -> None:
    deploy_cli.main(["--dry-run", "--kustomize", "k8s/overlays/h100"])
    printed = [o for o in yaml.safe_load_all(capsys.readouterr().out) if o]
    assert [o["kind"] for o in printed].count("Namespace") == 1  # the overlay's own, none added
    assert sum(o["kind"] == "Deployment" for o in printed) == 3  # workers, codec replicas, front


def test_topology_that_does_not_fit_the_node_is_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        deploy_cli.main(["--dry-run", "--workers", "8"])
    assert exit_.value.code == 2
    assert "8 LLM workers and 3 SNAC replicas need 9 GPUs, the node has 8" in capsys.readouterr().err


def test_topology_flags_only_shape_the_helm_render(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        deploy_cli.main(["--dry-run", "--kustomize", "k8s/overlays/h100", "--workers", "3"])
    assert "topology flags shape the Helm render only" in capsys.readouterr().err


def test_cluster_profile_counts_mig_instances_per_gpu() -> None:
    assert H100.gpus_needed() == 8 and H100.snac_gpus() == 1 and H100.mig_profile == "2g.20gb"
    four = H100.megapod.replace(workers=6, replicas=4)
    assert dataclasses.replace(H100, megapod=four).gpus_needed() == 8  # 6 whole + 2 GPUs of MIG
    with pytest.raises(ValueError, match="need 9 GPUs"):
        ClusterProfile("x", H100.megapod.replace(replicas=4), "values.yaml", 8, "nvidia.com/gpu",
                       "nvidia.com/mig-2g.20gb")


# ---------------------------------------------------------------- the real client over HTTP


class ApiServerDouble(ThreadingHTTPServer):
    """Test double of a Kubernetes API server on loopback: POST creates (409 when the object
    exists), PATCH records server-side applies, GET returns what was stored, with each Deployment
    reported fully rolled out. Enough for `megapod deploy` to run end to end with the real client."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _ApiHandler)
        self.objects: dict[str, dict] = {}
        self.requests: list[tuple[str, str, str]] = []  # (method, path with query, content type)


class _ApiHandler(BaseHTTPRequestHandler):
    server: ApiServerDouble

    def log_message(self, *_: object) -> None:  # keep test output clean
        pass

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        self.server.requests.append(("POST", self.path, self.headers["Content-Type"]))
        body = self._body()
        path = urlsplit(self.path).path + "/" + body["metadata"]["name"]
        if path in self.server.objects:
            self._reply(409, {"kind": "Status", "apiVersion": "v1", "code": 409, "reason": "AlreadyExists"})
            return
        body["metadata"]["generation"] = 1
        self.server.objects[path] = body
        self._reply(201, body)

    def do_PATCH(self) -> None:  # noqa: N802
        self.server.requests.append(("PATCH", self.path, self.headers["Content-Type"]))
        path = urlsplit(self.path).path
        body = {**self._body(), "metadata": {**self.server.objects[path]["metadata"], "generation": 2}}
        self.server.objects[path] = body
        self._reply(200, body)

    def do_GET(self) -> None:  # noqa: N802
        path = urlsplit(self.path).path
        obj = self.server.objects.get(path.removesuffix("/status"))
        if obj is None:
            self._reply(404, {"kind": "Status", "apiVersion": "v1", "code": 404})
            return
        if obj["kind"] == "Deployment":
            want = obj["spec"]["replicas"]
            obj = {**obj, "status": {"observedGeneration": obj["metadata"]["generation"], "replicas": want,
                                     "updatedReplicas": want, "readyReplicas": want, "availableReplicas": want}}
        self._reply(200, obj)


@pytest.fixture
def api_server():
    server = ApiServerDouble()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_megapod_deploy_end_to_end_through_the_real_client(api_server: ApiServerDouble, tmp_path: Path) -> None:
    """The `megapod` command, the `kubernetes` client's real paths and serialization, over HTTP."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "double",
        "clusters": [{"name": "double", "cluster": {"server": f"http://127.0.0.1:{api_server.server_port}"}}],
        "users": [{"name": "u", "user": {"token": "unused"}}],
        "contexts": [{"name": "double", "context": {"cluster": "double", "user": "u"}}],
    }))
    command = [sys.executable, "-m", "megapod", "deploy", "--profile", "cpu", "--timeout", "30"]
    environment = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    first = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=120)
    assert first.returncode == 0, first.stderr
    assert "deployment/orpheus-megapod-llm created" in first.stderr
    assert "speech   http://orpheus-megapod.orpheus-megapod.svc:8000/v1/audio/speech" in first.stdout
    stored = api_server.objects["/apis/apps/v1/namespaces/orpheus-megapod/deployments/orpheus-megapod-llm"]
    assert stored["spec"]["replicas"] == 2 and stored["spec"]["template"]["spec"]["containers"][0]["env"]
    assert not [r for r in api_server.requests if r[0] == "PATCH"]
    secret_path = "/api/v1/namespaces/orpheus-megapod/secrets/orpheus-megapod-codec-tls"
    certificates = dict(api_server.objects[secret_path]["data"])  # generated by Helm, mutual TLS on by default

    second = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=120)
    assert second.returncode == 0, second.stderr
    assert "deployment/orpheus-megapod-llm configured" in second.stderr
    patches = [r for r in api_server.requests if r[0] == "PATCH"]
    # Everything is server-side applied again but the generated TLS Secret, which is kept (the
    # second render generated other certificates), as Helm's lookup keeps it on `helm upgrade`.
    assert "secret/orpheus-megapod-codec-tls kept (exists)" in second.stderr
    assert len(patches) == len([r for r in api_server.requests if r[0] == "POST"]) // 2 - 1
    assert not [p for p in patches if urlsplit(p[1]).path == secret_path]
    assert api_server.objects[secret_path]["data"] == certificates
    for _, path, content_type in patches:
        query = parse_qs(urlsplit(path).query)
        assert content_type == APPLY_PATCH and query["fieldManager"] == [FIELD_MANAGER] and query["force"] == ["true"]

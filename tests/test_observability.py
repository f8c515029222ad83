"""Observability as an operator gets it from the chart: the PodMonitor, the alert rules and the
Grafana dashboard (monitoring.* in values.yaml), held against what the servers really export.

The chart half renders with the real `helm template`; the rules' expressions and the dashboard's
queries are parsed with a real PromQL parser (promql-parser), the dashboard is decoded into Grafana's
own dashboard types (grafana-foundation-sdk) and type-checked against them, and, where Debian's
`prometheus` package is installed, `promtool` checks the rules and runs alert unit tests on them.
The stack half starts `megapod up` (a worker with a real vLLM on the CPU, a codec replica, the
front), makes speech requests (one of them refused at the stream cap), scrapes every process and
checks that every series name and label the dashboard and the alerts select on is exported.
"""

from __future__ import annotations

import asyncio
import enum
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types
import typing
import urllib.request
from functools import cache
from pathlib import Path

import httpx
import promql_parser
import pytest
import yaml
from websockets.asyncio.client import connect
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models.dashboard import Dashboard
from processes import wait_metric_zero
from served import cartesia
from prometheus_client.parser import text_string_to_metric_families

from megapod.cluster import CPU, H100
from megapod.render import CHART, HelmRender, RenderError, find_helm, parse_manifests

REPO = Path(__file__).resolve().parent.parent
DASHBOARD_FILE = CHART / "dashboards" / "megapod.json"
README = REPO / "deploy" / "README.md"
RELEASE = NAMESPACE = "orpheus-megapod"
MONITORING = ("monitoring.podMonitor.enabled=true", "monitoring.rules.enabled=true",
              "monitoring.dashboard.enabled=true")
# Series Prometheus makes itself, one per target, rather than any process exporting them.
PROMETHEUS_SERIES = {"up"}
# Labels a series gets at scrape time: Prometheus Operator's for a PodMonitor target, and the
# chart's relabelings (tier, release). Everything else must be on the exported samples.
TARGET_LABELS = {"namespace", "pod", "container", "endpoint", "job", "instance", "tier", "release"}
# Grafana's own variables a query may use besides the dashboard's.
GRAFANA_VARIABLES = {"__rate_interval", "__interval", "__range"}
FRAME_S = 2048 / 24000  # one SNAC frame of audio


# ---------------------------------------------------------------- rendering


def render(profile=H100, *sets: str, values: dict | None = None) -> list[dict]:
    """`helm template` of a profile with --set pairs, and `values` as a values file (typed: --set
    gives a float as a string)."""
    try:
        helm = find_helm()
    except RenderError as exc:
        pytest.fail(f"{exc} -- the chart checks need it")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as extra:
        yaml.safe_dump(values or {}, extra)
        extra.flush()
        return parse_manifests(HelmRender(profile, release=RELEASE, namespace=NAMESPACE, values_files=[Path(extra.name)],
                                          set_values=sets).run(helm))


@cache
def monitored() -> tuple[dict, ...]:
    return tuple(render(H100, *MONITORING))


def one(objects, kind: str) -> dict:
    (obj,) = [o for o in objects if o["kind"] == kind]
    return obj


def alert_rules(objects=None) -> list[dict]:
    rule = one(objects or monitored(), "PrometheusRule")
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def dashboard() -> dict:
    return json.loads(DASHBOARD_FILE.read_text())


def panels(dash: dict) -> list[dict]:
    return [p for p in dash["panels"] if p["type"] != "row"]


# ---------------------------------------------------------------- PromQL


def grafana_to_promql(expr: str) -> str:
    """A dashboard query as Prometheus receives it: Grafana's variables replaced."""
    expr = expr.replace("$__rate_interval", "1m").replace("$__interval", "15s").replace("$__range", "1h")
    return re.sub(r"\$\{?(\w+)\}?", ".*", expr)


def selectors(expr: str) -> tuple[list, set[str]]:
    """Every vector selector in a PromQL expression and every label it groups or matches on."""
    found, grouping = [], set()

    def walk(node) -> None:
        if node is None or isinstance(node, (promql_parser.NumberLiteral, promql_parser.StringLiteral)):
            return
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)
        elif isinstance(node, promql_parser.MatrixSelector):
            found.append(node.vector_selector)
        elif isinstance(node, promql_parser.Call):
            for arg in node.args:
                walk(arg)
        elif isinstance(node, promql_parser.AggregateExpr):
            grouping.update(node.modifier.labels if node.modifier else ())
            walk(node.expr)
            walk(node.param if isinstance(node.param, promql_parser.Expr) else None)
        elif isinstance(node, promql_parser.BinaryExpr):
            if node.modifier and node.modifier.matching:
                grouping.update(node.modifier.matching.labels)
            walk(node.lhs)
            walk(node.rhs)
        elif isinstance(node, (promql_parser.ParenExpr, promql_parser.UnaryExpr, promql_parser.SubqueryExpr)):
            walk(node.expr)
        else:
            raise TypeError(f"a PromQL node this walker does not know: {type(node).__name__} in {expr}")

    walk(promql_parser.parse(expr))
    return found, grouping


def dashboard_queries(dash: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel query and every query variable (label_values(SELECTOR, LABEL))."""
    out = [(f"panel {p['title']!r} {t['refId']}", grafana_to_promql(t["expr"])) for p in panels(dash) for t in p["targets"]]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"])
            assert match, f"variable {var['name']}: not a label_values(selector, label) query"
            out.append((f"variable {var['name']}", grafana_to_promql(f"count by ({match[2]}) ({match[1]})")))
    return out


def rule_queries() -> list[tuple[str, str]]:
    return [(f"alert {r['alert']}", r["expr"]) for r in alert_rules()]


# ---------------------------------------------------------------- the chart


@pytest.mark.parametrize("profile", [H100, CPU], ids=["h100", "cpu"])
def test_monitoring_is_off_by_default(profile) -> None:
    objects = render(profile)
    kinds = {o["kind"] for o in objects}
    assert not kinds & {"PodMonitor", "ServiceMonitor", "PrometheusRule"}
    assert not any(o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-dashboard") for o in objects)
    # ...and each part comes alone when asked for.
    assert {o["kind"] for o in render(profile, MONITORING[0])} - kinds == {"PodMonitor"}
    assert {o["kind"] for o in render(profile, MONITORING[1])} - kinds == {"PrometheusRule"}
    assert len(render(profile, MONITORING[2])) == len(objects) + 1


def test_pod_monitor_scrapes_every_pod_of_both_tiers() -> None:
    objects = monitored()
    monitor = one(objects, "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == NAMESPACE
    selector = monitor["spec"]["selector"]
    deployments = {o["metadata"]["labels"]["app.kubernetes.io/component"]: o for o in objects if o["kind"] == "Deployment"}
    assert set(deployments) == {"llm", "snac", "front"}
    endpoints = {e["port"]: e for e in monitor["spec"]["podMetricsEndpoints"]}
    for tier, deployment in deployments.items():
        pod = deployment["spec"]["template"]
        labels = pod["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in selector["matchLabels"].items()), tier
        for expression in selector["matchExpressions"]:
            assert expression["operator"] == "In" and labels[expression["key"]] in expression["values"], tier
        ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        # the port Prometheus scrapes on this tier's pods: http on the workers, metrics on the codec
        assert len(ports & set(endpoints)) == 1, (tier, ports)
        for endpoint in endpoints.values():
            # each relabeling reads a pod label this tier's pods carry
            for relabel in endpoint["relabelings"]:
                (source,) = relabel["sourceLabels"]
                key = source.removeprefix("__meta_kubernetes_pod_label_")
                assert any(re.sub(r"[^a-zA-Z0-9_]", "_", k) == key for k in labels), (tier, source)
    assert set(endpoints) == {"http", "metrics"}
    assert {e["path"] for e in endpoints.values()} == {"/metrics"}
    assert {r["targetLabel"] for e in endpoints.values() for r in e["relabelings"]} == {"tier", "release"}
    # the LLM pods' http port is the one their container serves the API (and /metrics) on
    worker = deployments["llm"]["spec"]["template"]["spec"]["containers"][0]
    assert next(p for p in worker["ports"] if p["name"] == "http")["containerPort"] == 8000
    labelled = render(H100, MONITORING[0], "monitoring.podMonitor.labels.release=kube-prometheus-stack")
    assert one(labelled, "PodMonitor")["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_alert_rules_are_well_formed_and_select_only_this_release() -> None:
    rule = one(monitored(), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["metadata"]["namespace"] == NAMESPACE
    rules = alert_rules()
    names = {r["alert"] for r in rules}
    assert names == {
        "MegapodTimeToFirstAudioHigh", "MegapodRequestsRefused", "MegapodEngineQueueGrowing", "MegapodKvCacheFull",
        "MegapodCodecStepSlow", "MegapodCodecStepOverFrame", "MegapodTargetDown", "MegapodReplicasMissing",
        "MegapodTierDown", "MegapodStreamsBehindRealTime", "MegapodEventLoopLagging",
    }
    for r in rules:
        assert re.fullmatch(r"([0-9]+[smhdwy])+", r["for"]), r
        assert r["labels"]["severity"] in {"warning", "critical"}, r
        assert r["annotations"]["summary"] and r["annotations"]["description"], r
        found, _ = selectors(r["expr"])  # parses, or raises
        assert found, r["alert"]
        for selector in found:
            matchers = [(m.name, m.op, m.value) for m in selector.matchers.matchers]
            assert ("namespace", promql_parser.MatchOp.Equal, NAMESPACE) in matchers, (r["alert"], matchers)
            assert ("release", promql_parser.MatchOp.Equal, RELEASE) in matchers, (r["alert"], matchers)
        # Prometheus's own templates survive Helm's: {{ $value }} and {{ $labels.x }} reach Prometheus
        for text in r["annotations"].values():
            assert "{{" not in text or re.search(r"\{\{ \$(value|labels)", text), text


def test_alert_thresholds_come_from_values() -> None:
    def expr(objects, alert: str, tier: str = "") -> str:
        return next(r["expr"] for r in alert_rules(objects)
                    if r["alert"] == alert and r["labels"].get("tier", "") == tier)

    default = monitored()
    assert expr(default, "MegapodTimeToFirstAudioHigh").endswith("> 0.5")
    assert expr(default, "MegapodCodecStepOverFrame").endswith(f"> {FRAME_S:.4f}")
    assert float(expr(default, "MegapodCodecStepSlow").rsplit(">", 1)[1]) < FRAME_S
    assert expr(default, "MegapodEventLoopLagging").endswith(f"> {FRAME_S:.4f}")  # one frame: a gap in every stream
    assert expr(default, "MegapodReplicasMissing", "llm").endswith(f"< {H100.megapod.workers}")
    assert expr(default, "MegapodReplicasMissing", "snac").endswith(f"< {H100.megapod.replicas}")
    tuned = render(H100, MONITORING[1], "monitoring.rules.targetDownFor=3m", "llm.autoscaling.enabled=true",
                   "llm.autoscaling.minReplicas=2",
                   values={"monitoring": {"rules": {"timeToFirstAudioP95S": 0.25, "refusedRatio": 0.2,
                                                    "eventLoopLagP99S": 0.04}}})
    assert expr(tuned, "MegapodTimeToFirstAudioHigh").endswith("> 0.25")
    assert expr(tuned, "MegapodRequestsRefused").endswith("> 0.2")
    assert expr(tuned, "MegapodEventLoopLagging").endswith("> 0.04")
    assert expr(tuned, "MegapodReplicasMissing", "llm").endswith("< 2")  # the autoscaler's floor
    assert {r["for"] for r in alert_rules(tuned) if r["alert"] == "MegapodTargetDown"} == {"3m"}


@pytest.fixture(scope="module")
def promtool() -> str:
    # `make install` puts it beside the interpreter (deploy/tools/install_promtool.sh).
    path = shutil.which("promtool", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if path is None:
        pytest.skip("promtool not installed (deploy/tools/install_promtool.sh); the rules are still parsed by promql-parser")
    return path


def test_promtool_checks_the_rules(promtool, tmp_path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": one(monitored(), "PrometheusRule")["spec"]["groups"]}))
    done = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in done.stdout


def _series(name: str, labels: dict, values: str) -> dict:
    return {"series": name + "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}", "values": values}


def test_promtool_fires_each_alert_at_its_threshold(promtool, tmp_path) -> None:
    """Alert unit tests: synthetic series just over (and under) each threshold, evaluated by Prometheus's
    own rule engine, with the labels the chart's PodMonitor gives."""
    base = {"namespace": NAMESPACE, "release": RELEASE}
    llm = {**base, "tier": "llm", "pod": "w-0", "job": f"{NAMESPACE}/{RELEASE}"}
    snac = {**base, "tier": "snac", "pod": "s-0", "job": f"{NAMESPACE}/{RELEASE}"}
    front = {**base, "tier": "front", "pod": "f-0", "job": f"{NAMESPACE}/{RELEASE}"}

    def buckets(name, labels, per_minute: dict[str, int]):
        """A histogram whose observations per minute fall cumulatively into these le buckets."""
        return [_series(f"{name}_bucket", {**labels, "le": le}, f"0+{n}x30") for le, n in per_minute.items()]

    frame_le = repr(FRAME_S)  # the bucket bound orpheus_common/loop_lag.py exports at one frame

    def loop_lag(labels, late_share: float, from_minute: int = 0):
        """orpheus_event_loop_lag_seconds: 1200 wake-ups a minute (every 50 ms), all under 5 ms but `late_share`
        of them, which fall between 0.12 and 0.17 s (over a frame), from minute `from_minute` on."""
        per_minute = {"0.005": lambda m: 1200 if m < from_minute else round(1200 * (1 - late_share)),
                      frame_le: lambda m: 1200 if m < from_minute else round(1200 * (1 - late_share)),
                      "0.17": lambda m: 1200, "+Inf": lambda m: 1200}
        out = []
        for le, count in per_minute.items():
            total, values = 0, [0]
            for m in range(1, 31):
                total += count(m)
                values.append(total)
            out.append(_series("orpheus_event_loop_lag_seconds_bucket", {**labels, "le": le},
                               " ".join(map(str, values))))
        return out

    series = [
        # 100 requests a minute at the front: 10 answered 429 (10% > 5%)
        _series("megapod_front_replies_total", {**front, "status": "200"}, "0+90x30"),
        _series("megapod_front_replies_total", {**front, "status": "429"}, "0+10x30"),
        # first audio: 90% under 0.3 s, the rest between 0.75 and 1 s: p95 ~ 0.875 s > 0.5 s
        *buckets("orpheus_time_to_first_audio_seconds", llm, {"0.3": 90, "0.75": 90, "1.0": 100, "+Inf": 100}),
        # codec steps: all between 0.05 and 0.085 s on s-0 (p95 ~0.083 s: warning only)
        *buckets("snac_decode_step_seconds", snac, {"0.05": 0, "0.085": 600, "+Inf": 600}),
        # engine queue growing one a minute, KV cache 97% full
        _series("vllm:num_requests_waiting", {**llm, "engine": "0"}, "0+1x30"),
        _series("vllm:kv_cache_usage_perc", {**llm, "engine": "0"}, "0.97x30"),
        # w-0's engine at 0.9 x real time for its streams
        _series("megapod_worker_pace_ratio", llm, "0.9x30"),
        # event loops: w-0 wakes 2.5% of its tasks over a frame late (p99 ~0.136 s > 0.085 s) all along; f-0 0.5%
        # (p99 under a frame); f-1 10%, but only from minute 18: at 20m pending, not yet 5 minutes over
        *loop_lag(llm, 0.025), *loop_lag(front, 0.005), *loop_lag({**front, "pod": "f-1"}, 0.10, from_minute=18),
        # one worker up, one down from the start; one of two fronts up; the codec tier never scraped at all
        _series("up", {**llm, "pod": "w-0"}, "1x30"),
        _series("up", {**llm, "pod": "w-1"}, "0x30"),
        _series("up", front, "1x30"),
    ]
    at = "20m"
    alerts = {
        "MegapodRequestsRefused": [{}],
        "MegapodTimeToFirstAudioHigh": [{}],
        "MegapodCodecStepSlow": [{"pod": "s-0"}],
        "MegapodCodecStepOverFrame": [],  # under a whole frame: no critical
        "MegapodEngineQueueGrowing": [{"pod": "w-0"}],
        "MegapodKvCacheFull": [{"pod": "w-0"}],
        "MegapodStreamsBehindRealTime": [{"pod": "w-0"}],
        "MegapodEventLoopLagging": [{"tier": "llm", "pod": "w-0"}],
        "MegapodTargetDown": [{**llm, "pod": "w-1"}],
        "MegapodReplicasMissing": [{"tier": "llm"}, {"tier": "snac"}, {"tier": "front"}],  # 1 of 7, 0 of 3, 1 of 2
        "MegapodTierDown": [{"tier": "snac"}],
    }
    def severity(name: str, labels: dict) -> str:
        (rule,) = [r for r in alert_rules() if r["alert"] == name and r["labels"].get("tier", labels.get("tier")) == labels.get("tier")]
        return rule["labels"]["severity"]

    tests = [{
        "interval": "1m",
        "input_series": series,
        "alert_rule_test": [{
            "eval_time": at, "alertname": name,
            "exp_alerts": [{"exp_labels": {"severity": severity(name, labels), **labels}}
                           for labels in expected],
        } for name, expected in alerts.items()] + [{
            # f-1's loop lagging since minute 18 has been over a frame the rule's 5 minutes by 23m
            "eval_time": "24m", "alertname": "MegapodEventLoopLagging",
            "exp_alerts": [{"exp_labels": {"severity": severity("MegapodEventLoopLagging", {}), "tier": t, "pod": p}}
                           for t, p in (("llm", "w-0"), ("front", "f-1"))],
        }],
    }]
    # promtool compares annotations too; these tests are about the expressions (check_rules parses the
    # annotations' templates)
    groups = [{**g, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]}
              for g in one(monitored(), "PrometheusRule")["spec"]["groups"]]
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": groups}))
    spec = tmp_path / "tests.yaml"
    spec.write_text(yaml.safe_dump({"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": tests}))
    done = subprocess.run([promtool, "test", "rules", str(spec)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    # ...and a quiet MegaPod raises nothing: fast first audio, no refusals, quick steps, all up.
    quiet = [
        _series("megapod_front_replies_total", {**front, "status": "200"}, "0+100x30"),
        _series("megapod_front_replies_total", {**front, "status": "429"}, "0x30"),
        *buckets("orpheus_time_to_first_audio_seconds", llm, {"0.3": 100, "+Inf": 100}),
        *buckets("snac_decode_step_seconds", snac, {"0.02": 600, "+Inf": 600}),
        _series("vllm:num_requests_waiting", {**llm, "engine": "0"}, "0x30"),
        _series("vllm:kv_cache_usage_perc", {**llm, "engine": "0"}, "0.3x30"),
        _series("megapod_worker_pace_ratio", llm, "1.06x30"),
        *loop_lag(llm, 0.0), *loop_lag(front, 0.005),  # a few ms; the odd late wake-up stays under p99
        *[_series("up", {**llm, "pod": f"w-{i}"}, "1x30") for i in range(H100.megapod.workers)],
        *[_series("up", {**snac, "pod": f"s-{i}"}, "1x30") for i in range(H100.megapod.replicas)],
        *[_series("up", {**front, "pod": f"f-{i}"}, "1x30") for i in range(2)],
    ]
    tests = [{"interval": "1m", "input_series": quiet,
              "alert_rule_test": [{"eval_time": at, "alertname": name, "exp_alerts": []} for name in alerts]}]
    spec.write_text(yaml.safe_dump({"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": tests}))
    done = subprocess.run([promtool, "test", "rules", str(spec)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dashboard_configmap_ships_the_file_for_grafanas_sidecar() -> None:
    maps = [o for o in monitored() if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-dashboard")]
    (config_map,) = maps
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == NAMESPACE
    (name, text), = config_map["data"].items()
    assert name.endswith(".json") and json.loads(text) == dashboard()
    elsewhere = render(H100, MONITORING[2], "monitoring.dashboard.namespace=grafana",
                       "monitoring.dashboard.sidecarLabel=dashboards", "monitoring.dashboard.sidecarLabelValue=megapod",
                       "monitoring.dashboard.annotations.grafana_folder=TTS")
    moved = next(o for o in elsewhere if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-dashboard"))
    assert moved["metadata"]["namespace"] == "grafana"
    assert moved["metadata"]["labels"]["dashboards"] == "megapod" and "grafana_dashboard" not in moved["metadata"]["labels"]
    assert moved["metadata"]["annotations"] == {"grafana_folder": "TTS"}


# ---------------------------------------------------------------- the dashboard


def _type_errors(value, hint, path: str, errors: list) -> bool:
    """Whether `value` (as grafana-foundation-sdk decoded it) is of Grafana's schema type `hint`;
    every mismatch goes to `errors`."""
    def fail() -> bool:
        errors.append(f"{path}: {value!r:.60} is not {hint}")
        return False

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in (typing.Any, object):  # a panel's options and field config: the plugin's own types
        if type(value).__module__.startswith("grafana_foundation_sdk.models"):
            return _type_errors(value, type(value), path, errors)
        return True
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return True
        for arm in args:  # the arm the decoder chose, where it chose one
            if isinstance(arm, type) and type(value).__module__.startswith("grafana_foundation_sdk") and isinstance(value, arm):
                return _type_errors(value, arm, path, errors)
            if typing.get_origin(arm) is list and isinstance(value, list):
                return _type_errors(value, arm, path, errors)
        return any(_type_errors(value, arm, path, []) for arm in args if arm is not type(None)) or fail()
    if origin is typing.Literal:
        return value in args or fail()
    if origin is list:
        # lists, not generators, here and below: every error is collected, not only the first
        return isinstance(value, list) and all(
            [_type_errors(v, args[0], f"{path}[{i}]", errors) for i, v in enumerate(value)]) or fail()  # noqa: C419
    if origin is dict:
        return isinstance(value, dict) or fail()
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return isinstance(value, hint) or value in {m.value for m in hint} or fail()
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) or fail()
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool) or fail()
    if hint in (str, bool):
        return isinstance(value, hint) or fail()
    if isinstance(hint, type):
        if not isinstance(value, hint):
            return fail()
        return all([_type_errors(getattr(value, k), h, f"{path}.{k}", errors)  # noqa: C419
                    for k, h in typing.get_type_hints(hint).items()])
    return True


def _missing(original, decoded, path: str = "") -> list[str]:
    """Where `original` has a key or value that Grafana's types dropped or changed on the round trip."""
    if isinstance(original, dict):
        if not isinstance(decoded, dict):
            return [f"{path}: became {decoded!r:.40}"]
        return [m for k, v in original.items()
                for m in ([f"{path}/{k}: not in Grafana's schema"] if k not in decoded else _missing(v, decoded[k], f"{path}/{k}"))]
    if isinstance(original, list):
        if not isinstance(decoded, list) or len(original) != len(decoded):
            return [f"{path}: list changed"]
        return [m for i, (a, b) in enumerate(zip(original, decoded)) for m in _missing(a, b, f"{path}[{i}]")]
    return [] if original == decoded else [f"{path}: {original!r} became {decoded!r}"]


def test_dashboard_is_valid_against_grafanas_dashboard_types() -> None:
    """Decoded into grafana-foundation-sdk's Dashboard (Grafana's schema as generated types, panel
    plugins' options and field config included): nothing is dropped on the way back to JSON, and
    every value has its schema type."""
    register_default_plugins()
    original = dashboard()
    decoded = Dashboard.from_json(original)
    assert _missing(original, json.loads(json.dumps(decoded, cls=JSONEncoder))) == []
    errors: list[str] = []
    _type_errors(decoded, Dashboard, "dashboard", errors)
    assert errors == []
    # The checks bite: a wrong type and an unknown key are both caught.
    broken = dashboard()
    broken["panels"][1]["gridPos"]["h"] = "4"
    broken["panels"][1]["options"]["legend"] = {"placement": "top"}
    broken["panels"][1]["fieldConfig"]["defaults"]["colour"] = "red"
    errors = []
    _type_errors(Dashboard.from_json(broken), Dashboard, "dashboard", errors)
    assert len(errors) >= 1 and "grid_pos.h" in errors[0]
    assert _missing(broken, json.loads(json.dumps(Dashboard.from_json(broken), cls=JSONEncoder)))


def test_dashboard_layout_and_queries_hold_together() -> None:
    """What Grafana's loader assumes: unique panel ids, panels inside the 24-column grid and not on top
    of each other, every query on the dashboard's data source variable, every variable it names
    defined, every query valid PromQL."""
    dash = dashboard()
    assert dash["uid"] and 8 <= len(dash["uid"]) <= 40 and dash["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
    defined = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "namespace", "release"} <= defined
    for p in panels(dash):
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and len({t["refId"] for t in p["targets"]}) == len(p["targets"])
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"]
            used = set(re.findall(r"\$\{?(\w+)", t["expr"]))
            assert used <= defined | GRAFANA_VARIABLES, (p["title"], used)
            assert {"namespace", "release"} <= used, f"{p['title']!r} ignores the namespace/release pickers"
    for where, expr in dashboard_queries(dash):
        assert selectors(expr)[0], where  # parses, or raises


def test_dashboard_covers_what_an_operator_watches() -> None:
    names = {s.name for _, expr in dashboard_queries(dashboard()) for s in selectors(expr)[0]}
    for needed in (
        "orpheus_active_streams", "orpheus_time_to_first_audio_seconds_bucket",
        "orpheus_time_to_first_audible_audio_seconds_bucket", "orpheus_audio_seconds_total", "orpheus_requests_total",
        "snac_batch_size_bucket", "snac_decode_step_seconds_bucket", "snac_decoded_frames_total",
        "snac_emitted_frames_total", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "up",
        "orpheus_event_loop_lag_seconds_bucket", "orpheus_socket_budget_refusals_total",
    ):
        assert needed in names, needed
    for title in ("Decode step time", "Event-loop lag"):
        panel = next(p for p in panels(dashboard()) if p["title"] == title)
        frame = [s["value"] for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"] if s["color"] == "red"]
        assert frame == [round(FRAME_S, 4)], title
    # the loop lag per pod: the workers' and the front's loops each on their own line
    lag = next(p for p in panels(dashboard()) if p["title"] == "Event-loop lag")
    assert [(t["expr"].split(",")[0], "by (le, pod)" in t["expr"]) for t in lag["targets"]] == [
        ("histogram_quantile(0.5", True), ("histogram_quantile(0.99", True)]


def test_readme_lists_every_panel_and_alert() -> None:
    text = README.read_text()
    assert "## Monitoring" in text
    section = text.split("## Monitoring", 1)[1].split("\n## ", 1)[0]
    for p in dashboard()["panels"]:
        assert (f"*{p['title']}*" if p["type"] == "row" else f"**{p['title']}**") in section, p["title"]
    for name in {r["alert"] for r in alert_rules()}:
        assert f"`{name}`" in section, name


# ---------------------------------------------------------------- against the running stack


@pytest.fixture(scope="module")
def stack(megapod):
    """The session's `megapod up` (conftest.megapod): the front, workers on real vLLM (CPU, random
    weights), codec replicas."""
    return megapod


class Scrape:
    """/metrics endpoints as read together: series name -> label name -> values seen, and each name's total."""

    def __init__(self, *ports: int) -> None:
        self.labels: dict[str, dict[str, set[str]]] = {}
        self.totals: dict[str, float] = {}
        for port in ports:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
                text = reply.read().decode()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    labels = self.labels.setdefault(sample.name, {})
                    for key, value in sample.labels.items():
                        labels.setdefault(key, set()).add(value)
                    self.totals[sample.name] = self.totals.get(sample.name, 0.0) + sample.value


async def _hold_every_slot(worker_ports: list[int], per_worker: int) -> list:
    """Every stream slot of every worker taken."""
    sockets = []
    for port in worker_ports:
        sockets.append(ws := await connect(f"ws://127.0.0.1:{port}/tts/websocket"))
        for i in range(per_worker):
            await ws.send(cartesia(f"hold-{i}", ""))  # no text yet: it holds its slot, generating nothing
        await ws.send(cartesia("one-more", ""))
        refusal = json.loads(await asyncio.wait_for(ws.recv(), 60))  # after the contexts before it opened
        assert (refusal["context_id"], refusal["status_code"]) == ("one-more", 429), refusal
    return sockets


async def _speak_and_be_refused(stack: dict) -> tuple[int, int]:
    """One speech request through the front, whole; then every worker's slots held (straight at the
    workers) while a second comes through the front: every worker refuses it, so the front does.
    Returns (audio bytes of the first, status of the second)."""
    body = {"model": "tts-1", "input": "Hello there, operator.", "voice": "tara", "response_format": "pcm"}
    workers = [worker.port for worker in stack["llm"]]
    async with httpx.AsyncClient(base_url=stack["url"], timeout=300) as http:
        first = await http.post("/v1/audio/speech", json=body)
        assert first.status_code == 200
        sockets = await _hold_every_slot(workers, stack["max_streams"])
        try:
            second = await http.post("/v1/audio/speech", json={**body, "input": "Me too."})
        finally:
            for ws in sockets:  # a barge-in: the worker frees the slots at once
                await ws.close()
    for port in workers:  # the session's other tests get a free stack
        assert wait_metric_zero(port, "orpheus_active_streams", within_s=60) == 0
    return len(first.content), second.status_code


async def _flood_a_socket(port: int, messages: int = 3000) -> None:
    """More messages at once than one socket's budget lets through (llm_server.config socket_messages_per_s:
    a burst of 5 seconds' worth): the worker refuses the rest unread (orpheus_socket_budget_refusals_total) and
    says so once. Each is a cancel of a context that does not exist: nothing to do for those let in."""
    async with connect(f"ws://127.0.0.1:{port}/tts/websocket") as ws:
        for _ in range(messages):
            await ws.send(json.dumps({"context_id": "flood", "cancel": True}))
        while True:  # until the refusal: every message before it was counted
            reply = json.loads(await asyncio.wait_for(ws.recv(), 60))
            if reply.get("status_code") == 429:
                break


@pytest.fixture(scope="module")
def exported(stack) -> dict[str, Scrape]:
    received, refused = asyncio.run(_speak_and_be_refused(stack))
    assert received > 0 and refused == 429
    asyncio.run(_flood_a_socket(stack["llm"][0].port))  # so the socket budget's counter has a sample
    return {"worker": Scrape(*(worker.metrics_port for worker in stack["llm"])),
            "codec": Scrape(*(replica.metrics_port for replica in stack["snac"])), "front": Scrape(stack["front_port"])}


def test_speech_gives_the_histograms_samples(exported) -> None:
    worker, codec, front = exported["worker"], exported["codec"], exported["front"]
    assert worker.totals["orpheus_time_to_first_audio_seconds_count"] >= 1
    assert worker.totals["vllm:time_to_first_token_seconds_count"] >= 1  # vLLM's own, served by the worker
    assert worker.totals["vllm:generation_tokens_total"] >= 7
    assert codec.totals["snac_decode_step_seconds_count"] >= 1
    assert codec.totals["snac_emitted_frames_total"] >= 1
    assert codec.totals["snac_decoded_frames_total"] >= codec.totals["snac_emitted_frames_total"]
    assert {"ok", "refused"} <= worker.labels["orpheus_requests_total"]["outcome"]
    assert "429" in front.labels["megapod_front_requests_total"]["status"]  # the front saw the refusal too
    assert "429" in front.labels["megapod_front_replies_total"]["status"]  # ...and answered the client with it
    assert "megapod_front_active_streams" in front.labels
    # both servers' event loops are watched (every 50 ms), and the flood was refused
    for server in (worker, front):
        assert server.totals["orpheus_event_loop_lag_seconds_count"] >= 1
        assert server.totals["orpheus_event_loop_lag_max_seconds"] >= 0
    assert "refused" in worker.labels["orpheus_socket_budget_refusals_total"]["action"]
    # each tier exports its own: the PodMonitor's two ports do not overlap
    assert not any(name.startswith(("vllm:", "orpheus_")) for name in codec.labels)
    assert not any(name.startswith("snac_") for name in worker.labels)


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_series_and_label_used_is_exported(exported, source: str) -> None:
    """Every series name the dashboard's queries or the alert rules select is exported by a worker or a
    codec replica or the front (the pods the PodMonitor scrapes), with every
    label they match or group on, and every value they match exactly."""
    scraped = {**exported["codec"].labels, **exported["worker"].labels, **exported["front"].labels}
    queries = dashboard_queries(dashboard()) if source == "dashboard" else rule_queries()
    assert len(queries) >= 9
    checked = set()
    for where, expr in queries:
        found, grouping = selectors(expr)
        names = {s.name for s in found}
        for selector in found:
            if selector.name in PROMETHEUS_SERIES:
                continue
            assert selector.name in scraped, f"{where}: {selector.name} is not exported ({expr})"
            labels = scraped[selector.name]
            for m in selector.matchers.matchers:
                assert m.name in labels or m.name in TARGET_LABELS, f"{where}: {selector.name} has no label {m.name}"
                if m.op == promql_parser.MatchOp.Equal and m.name in labels:
                    assert m.value in labels[m.name], f"{where}: {selector.name}{{{m.name}={m.value!r}}} never seen"
            checked.add(selector.name)
        exported_labels = set().union(*(scraped[n].keys() for n in names if n in scraped))
        assert grouping <= exported_labels | TARGET_LABELS, f"{where}: groups by {grouping - exported_labels - TARGET_LABELS}"
    assert len(checked) >= (12 if source == "dashboard" else 4)

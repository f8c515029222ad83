"""The chart's values.schema.json, generated: Helm checks every value against it before rendering.

    python -m megapod.values_schema          # rewrite deploy/helm/orpheus-megapod/values.schema.json
    python -m megapod.values_schema --check  # exit 1 when the file is not what this generates

Where each part comes from:
  * structure and types: values.yaml. Objects refuse unknown keys and require every key values.yaml
    sets (the templates read them all); empty maps and lists stay open.
  * llm.server, snac.server and front.server: the fields of LlmServerConfig, SnacServerConfig and
    FrontConfig, camelCase, with the types, bounds and enums of the settings' own JSON schema (the
    checks the servers run at start-up fail at `helm install` instead), less those the templates set themselves (an ORPHEUS_<FIELD> or SNAC_<FIELD> variable
    written out in a template). Required there: only the keys the templates read (`server.<key>`);
    any other key left out is the server's own default.
  * descriptions of the values `megapod deploy` sets from MegaPodConfig: each field says where it
    goes (MegaPodConfig.chart_paths), which also gives `megapod deploy` its flags.
  * OPEN and RULES below: what none of those can say (the chart's own enums, bounds, patterns).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import yaml

from llm_server.config import LlmServerConfig
from orpheus_common.settings import Settings, camel
from orpheus_front.front import FrontConfig
from snac_server.config import SnacServerConfig

from .render import CHART
from .topology import MegaPodConfig

SCHEMA = CHART / "values.schema.json"
COMMAND = "python -m megapod.values_schema"
SERVERS = {"llm": (LlmServerConfig, "ORPHEUS_"), "snac": (SnacServerConfig, "SNAC_"), "front": (FrontConfig, "MEGAPOD_FRONT_")}
# Fields no pod may set: the servers' default host (0.0.0.0) is what makes a pod reachable; the
# front's static worker list would contradict the workers' Service the chart gives it.
# TLS files are a Secret the chart mounts (front.tls), not paths a value names.
KEEP_DEFAULT = {"host", "workers", "ssl_certfile", "ssl_keyfile", "ssl_ca_certs"}

STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
NAMED_ITEMS = {"type": "array", "items": {"type": "object", "required": ["name"]}}
OBJECTS = {"type": "array", "items": {"type": "object"}}
PORT = {"minimum": 1, "maximum": 65535}
SECRET_NAME = {"pattern": "^$|^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", "maxLength": 253}  # or empty: none
DURATION = {"pattern": "^([0-9]+(\\.[0-9]+)?(h|m|s))+$"}  # Go durations, as cert-manager takes them
PROMETHEUS_DURATION = {"pattern": "^([0-9]+(ms|s|m|h|d|w|y))+$"}
AT_LEAST_1, AT_LEAST_0, POSITIVE = {"minimum": 1}, {"minimum": 0}, {"exclusiveMinimum": 0}

# Values whose contents values.yaml only gives an example of (dotted path globs -> whole schema).
OPEN = {
    "podSecurityContext": {"type": "object"},  # the rendered pods meet the Kubernetes schemas (tests)
    "securityContext": {"type": "object"},
    "placement.nodeSelector": STRING_MAP,
    "**.annotations": STRING_MAP,
    "**.labels": STRING_MAP,
    "*.resources.requests": STRING_MAP,  # quantities as strings: the Python client refuses numbers
    "*.resources.limits": STRING_MAP,
    "imagePullSecrets": NAMED_ITEMS,
    "*.extraEnv": NAMED_ITEMS,
    "placement.tolerations": OBJECTS,
    "networkPolicy.metricsFrom": OBJECTS,
}
# Constraints merged into what values.yaml and the configs give (dotted path globs; "" is the root).
# Each must match some value: a rule left behind by a renamed key fails the generator.
RULES = {
    "": {"properties": {"global": {"type": "object"}}},  # Helm's own
    "clusterDomain": {"minLength": 1},
    "images.*.repository": {"minLength": 1},
    "images.*.tag": {"minLength": 1},
    "images.*.pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
    "*.replicas": AT_LEAST_0,
    "*.accelerator.resource": {"pattern": "^$|^[a-z0-9.-]+/[a-z0-9.-]+$"},  # e.g. nvidia.com/mig-2g.20gb
    "*.accelerator.count": AT_LEAST_1,
    "llm.model.source": {"enum": ["huggingface", "pvc"]},
    "llm.model.id": {"minLength": 1},
    "llm.model.cache.accessMode": {"enum": ["ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod"]},
    "llm.voices.accessMode": {"enum": ["ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod"]},
    "*.probes.*": {"properties": {"successThreshold": {"type": "integer", **AT_LEAST_1},
                                  "initialDelaySeconds": {"type": "integer", **AT_LEAST_0}}},
    "*.probes.*.*Seconds": AT_LEAST_1,
    "*.probes.*.failureThreshold": AT_LEAST_1,
    "*.podDisruptionBudget.maxUnavailable": {"anyOf": [{"type": "integer", **AT_LEAST_1},
                                                       {"type": "string", "pattern": "^[0-9]+%$"}]},
    "llm.autoscaling.*Replicas": AT_LEAST_1,
    "llm.autoscaling.targetCapacityUsed": {"type": "number", **POSITIVE, "maximum": 1},
    "service.type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
    "service.sessionAffinity": {"enum": ["None", "ClientIP"]},
    "service.externalTrafficPolicy": {"enum": ["Local", "Cluster"]},
    "*.port": PORT,
    "*.server.port": PORT,
    "snac.server.metricsPort": PORT,  # the Service and the NetworkPolicy name it
    # A pod owns its GPUs: no cuda:N (MegaPodConfig's llm_device and snac_device, and their check).
    "*.server.device": {"enum": ["auto", "cpu", "cuda"]},
    "drain.*": {"type": "number", **AT_LEAST_0},  # MegaPodConfig grace_s, endpoint_delay_s
    "snac.server.healthPort": PORT,  # the kubelet's gRPC probes name it
    "*.existing*Secret": SECRET_NAME,
    "front.tls.existingSecret": SECRET_NAME,
    "llm.autoscaling.autoscaler": {"enum": ["hpa", "keda"]},
    "llm.autoscaling.keda.prometheusAddress": {"pattern": "^https?://[^/]+"},
    "llm.autoscaling.keda.refusedPerSecond": POSITIVE,
    "llm.autoscaling.keda.timeToFirstAudioP95S": POSITIVE,
    "llm.autoscaling.keda.pollingIntervalS": AT_LEAST_1,
    "codecTls.certManager.issuerRef.kind": {"minLength": 1},
    "codecTls.certManager.issuerRef.group": {"minLength": 1},
    "codecTls.certManager.duration": DURATION,
    "codecTls.certManager.renewBefore": DURATION,
    "codecTls.certManager.privateKeyAlgorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
    "codecTls.generated.*": AT_LEAST_1,
    "apiKeys.key": {"minLength": 1, "pattern": "^[-._a-zA-Z0-9]+$"},
    "monitoring.podMonitor.interval": PROMETHEUS_DURATION,
    "monitoring.podMonitor.scrapeTimeout": PROMETHEUS_DURATION,
    "monitoring.rules.targetDownFor": PROMETHEUS_DURATION,
    "monitoring.rules.*S": POSITIVE,  # latency thresholds in seconds
    "monitoring.rules.refusedRatio": {**POSITIVE, "maximum": 1},
    "monitoring.rules.kvCacheUsage": {**POSITIVE, "maximum": 1},
    "monitoring.rules.minPace": POSITIVE,
    "monitoring.rules.engineWaitingRequests": AT_LEAST_0,
    "monitoring.dashboard.sidecarLabel": {"minLength": 1},
}
# What a field's JSON schema says that a values schema keeps (not its title or default).
KEPT = ("type", "enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "items", "minItems",
        "contains")


def field_schema(cls: type[Settings], name: str) -> dict:
    """The types, bounds and enums pydantic gives a settings field: the server's own checks of one value."""
    prop = cls.model_json_schema()["properties"][name]
    # An optional field (None: the server's own default) is left out of the values, never null: its value's branch.
    prop = next((branch for branch in prop.get("anyOf", ()) if branch.get("type") != "null"), prop)
    return {key: prop[key] for key in KEPT if key in prop}


def json_type(value: object) -> dict:
    """A values.yaml example's type."""
    return {"type": {bool: "boolean", int: "integer", float: "number", str: "string"}[type(value)]}


# ---------------------------------------------------------------- the schema


def _matches(path: str, pattern: str) -> bool:
    """`*` matches within one key, `**` across keys: `**.labels` is every labels map."""
    regex = re.escape(pattern).replace(r"\*\*", ".*").replace(r"\*", "[^.]*")
    return re.fullmatch(regex, path) is not None


def _from_values(value: object, path: str, opened: set[str]) -> dict:
    """A value's schema from its example in values.yaml."""
    for pattern, schema in OPEN.items():
        if _matches(path, pattern):
            opened.add(pattern)
            return json.loads(json.dumps(schema))  # a copy: rules may add to it
    if isinstance(value, dict):
        if not value:
            return {"type": "object"}
        children = {key: _from_values(child, f"{path}.{key}".lstrip("."), opened) for key, child in value.items()}
        return {"type": "object", "additionalProperties": False, "required": list(value), "properties": children}
    if isinstance(value, list):
        return {"type": "array", "items": _from_values(value[0], f"{path}[]", opened)} if value else {"type": "array"}
    if value is None:
        raise ValueError(f"values.yaml: {path} is null; give it a value of its type")
    return json_type(value)


def _server(tier: str, values: dict, templates: str) -> dict:
    """llm.server / snac.server / front.server: the settings model's fields, as the chart lets a pod set them."""
    cls, prefix = SERVERS[tier]
    set_by_chart = {name.lower() for name in re.findall(rf"name:\s*{prefix}(\w+)", templates)} & cls.model_fields.keys()
    fields = [name for name in cls.model_fields if name not in set_by_chart | KEEP_DEFAULT]
    properties = {camel(name): field_schema(cls, name) for name in fields}
    if unknown := set(values) - set(properties):
        raise ValueError(f"values.yaml: {tier}.server sets {sorted(unknown)}, not {cls.__name__} fields a pod may set")
    # `$llm.server.port`, `.Values.snac.server.port`, and helpers' `.server.graceS` (either tier)
    read = {key for owner, key in re.findall(r"(\w*)\.server\.(\w+)", templates) if owner in ("", tier)}
    return {
        "type": "object",
        "description": f"{cls.__name__} fields ({cls.__module__}) in camelCase, each rendered as its "
                       f"{prefix}<FIELD> variable; the chart sets {', '.join(sorted(map(camel, set_by_chart)))} itself",
        "additionalProperties": False,
        "required": [key for key in values if key in read],
        "properties": properties,
    }


def _merge(schema: dict, rule: dict) -> None:
    for key, value in rule.items():
        if isinstance(value, dict) and isinstance(schema.get(key), dict):
            _merge(schema[key], value)
        else:
            schema[key] = json.loads(json.dumps(value))
    if "anyOf" in rule:
        schema.pop("type", None)  # the alternatives carry the types


def _apply(schema: dict, path: str, rules: list[tuple[str, dict]], used: set[int]) -> None:
    for name, child in schema.get("properties", {}).items():
        _apply(child, f"{path}.{name}".lstrip("."), rules, used)
    for i, (pattern, rule) in enumerate(rules):
        if _matches(path, pattern):
            _merge(schema, rule)
            used.add(i)


def generate() -> dict:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    templates = "\n".join(p.read_text() for p in sorted((CHART / "templates").iterdir()) if p.is_file())
    opened: set[str] = set()
    root = _from_values(values, "", opened)
    for tier in SERVERS:
        root["properties"][tier]["properties"]["server"] = _server(tier, values[tier]["server"], templates)
    rules = list(RULES.items())
    used: set[int] = set()
    _apply(root, "", rules, used)
    if unused := [pattern for i, (pattern, _) in enumerate(rules) if i not in used] + sorted(OPEN.keys() - opened):
        raise ValueError(f"rules that match no value (renamed?): {unused}")
    for field, paths in MegaPodConfig.chart_paths().items():
        flag = f"--{field.replace('_', '-')}"
        for path in paths:
            node = root
            for key in path.split("."):
                node = node["properties"][key]  # KeyError: a field sets a value the chart lacks
            node["description"] = f"megapod deploy {flag} (MegaPodConfig.{field})"
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "$comment": f"Generated by `{COMMAND}` (megapod/values_schema.py) from values.yaml and the "
                    "server configs. Do not edit: change those, then run it again.",
        "title": "orpheus-megapod values",
        **root,
    }


def render() -> str:
    text = json.dumps(generate(), indent=2)
    # Lists of scalars on one line (JSON strings hold no newline, so ",\n" only separates items).
    flat = re.sub(r"\[\n\s+([^\[\]{}]*?)\n\s*\]", lambda m: "[" + ", ".join(re.split(r",\n\s*", m[1])) + "]", text)
    return flat + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the schema file is stale, write nothing")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if SCHEMA.read_text() != text:
            sys.exit(f"{SCHEMA} is stale: run `{COMMAND}`")
        return
    SCHEMA.write_text(text)


if __name__ == "__main__":
    main()

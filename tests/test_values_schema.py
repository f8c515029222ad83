"""values.schema.json is generated (megapod/values_schema.py) and still refuses bad values;
`megapod deploy`'s topology flags are the MegaPodConfig fields the chart receives."""

from __future__ import annotations

import dataclasses
import subprocess

import jsonschema
import pytest
import yaml

from megapod import deploy_cli
from megapod.cluster import CPU, H100
from megapod.render import CHART, find_helm, parse_manifests, profile_values
from megapod.topology import MegaPodConfig
from megapod.values_schema import COMMAND, SCHEMA, SERVERS, field_schema, render
from orpheus_common.settings import camel


def helm_template(*sets: str, how: str = "--set") -> tuple[int, str, str]:
    argv = [find_helm(), "template", "orpheus-megapod", str(CHART)]
    for pair in sets:
        argv += [how, pair]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    return done.returncode, done.stdout, done.stderr


def env(objects: list[dict], tier: str) -> dict[str, str]:
    (deployment,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith(f"-{tier}")]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value") for e in container["env"]}


def test_committed_schema_is_the_generated_one() -> None:
    assert SCHEMA.read_text() == render(), f"values.schema.json is stale: run `{COMMAND}`"


@pytest.mark.parametrize(
    "pair, named",
    [
        ("snac.server.maxBatchSize=64", "maxBatchSize"),  # not a SnacServerConfig field
        ("llm.server.model=x", "model"),  # a field the chart sets itself (from llm.model)
        ("snac.server.tlsCert=/x", "tlsCert"),  # ... from codecTls
        ("llm.server.host=127.0.0.1", "host"),  # would make the pod unreachable
        ("llm.probes.startup.periodSecond=5", "periodSecond"),  # a typo in a closed object
        ("monitors=true", "monitors"),  # an unknown top-level key
        ("llm.replicas=seven", "llm.replicas"),  # wrong type (values.yaml's)
        ("snac.server.maxWaitMs=soon", "snac.server.maxWaitMs"),  # wrong type (the settings model's)
        ("images.llm.pullPolicy=Sometimes", "pullPolicy"),  # enum kept in RULES
        ("llm.server.trtllmAttention=maybe", "trtllmAttention"),  # the settings' own (LlmServerConfig's Literal)
        ("snac.server.dtype=float64", "dtype"),
        ("llm.server.topP=1.5", "topP"),
        ("snac.server.frameBuckets={2,4}", "frameBuckets"),  # no 1
        ("llm.server.device=cuda:1", "device"),  # a pod owns its GPUs
        ("service.port=70000", "service.port"),
        ("llm.server.port=null", "port"),  # required: the templates read it
    ],
)
def test_schema_refuses_bad_values(pair: str, named: str) -> None:
    code, _, stderr = helm_template(pair)
    assert code != 0 and "schema" in stderr and named in stderr, stderr


def test_schema_accepts_server_settings_values_yaml_leaves_at_their_defaults() -> None:
    """Any pod-settable field may be set, not only those values.yaml lists, and reaches the pod."""
    code, stdout, stderr = helm_template(
        "llm.server.topP=0.9", "llm.server.maxBodyBytes=131072", "snac.server.frameBuckets=[1,4]",
        "llm.probes.startup.successThreshold=1", "llm.server.quantization=null", how="--set-json")  # --set: 0.9 a string
    assert code == 0, stderr
    llm, snac = env(parse_manifests(stdout), "llm"), env(parse_manifests(stdout), "snac")
    assert (llm["ORPHEUS_TOP_P"], llm["ORPHEUS_MAX_BODY_BYTES"], snac["SNAC_FRAME_BUCKETS"]) == ("0.9", "131072", "1,4")
    assert "ORPHEUS_QUANTIZATION" not in llm  # null: the server's own default


# ---------------------------------------------------------------- the schema holds the servers' checks

SAMPLES = {"integer": [-2, -1, 0, 1, 2, 15, 16, 17, 70000], "number": [-1.0, 0.0, 0.5, 1.0, 1.5, 2.0],
           "array": [()], "array of integer": [(), (1,), (2, 4), (1, 0), (1, 2, 4)]}


def _cases() -> list:
    """(tier, settings class, field, sample values) for every numeric, list or enum field a pod may set."""
    schema = yaml.safe_load(SCHEMA.read_text())  # JSON is YAML
    cases = []
    for tier, (cls, _) in SERVERS.items():
        settable = schema["properties"][tier]["properties"]["server"]["properties"]
        for name in cls.model_fields:
            check = field_schema(cls, name)
            if camel(name) not in settable or not ("enum" in check or check.get("type") in SAMPLES):
                continue
            if "enum" in check:
                first = check["enum"][0]  # and one value outside the enum, of its type
                samples = [*check["enum"], f"not-{first}" if isinstance(first, str) else max(check["enum"]) - 1]
            elif check.get("items", {}).get("type") == "integer":
                samples = SAMPLES["array of integer"]
            else:
                samples = [*SAMPLES[check["type"]], *([cls.default(name)] if check["type"] == "array" else [])]
            cases.append(pytest.param(tier, cls, name, samples, id=f"{tier}.{name}"))
    return cases


# What a config needs besides the field under test (the chart always sets it).
REQUIRED = {"front": {"workers_dns": "orpheus-megapod-llm.ns.svc.cluster.local:8000"}}


@pytest.mark.parametrize("tier, cls, name, samples", _cases())
def test_the_schema_refuses_what_the_server_refuses(tier: str, cls: type, name: str, samples: list) -> None:
    """A value the server's settings refuse (a field's bounds, or a rule between fields) fails at
    `helm install`, and one they take passes (before the chart's own, stricter RULES): a rule
    written only in a model validator fails here until the field says it too."""
    schema = field_schema(cls, name)
    for value in samples:
        try:
            cls(**{**REQUIRED.get(tier, {}), name: value})
            server_takes = True
        except ValueError:  # pydantic's ValidationError
            server_takes = False
        schema_takes = jsonschema.Draft7Validator(schema).is_valid(list(value) if isinstance(value, tuple) else value)
        assert schema_takes == server_takes, f"{cls.__name__}.{name}={value!r}: server {server_takes}, schema {schema_takes}"


# ---------------------------------------------------------------- megapod deploy's topology flags


def test_deploy_flags_are_the_fields_the_chart_receives() -> None:
    """Every MegaPodConfig field with no flag leaves the chart values alone, so none is missing."""
    changed = {int: lambda v: v + 1, float: lambda v: v / 2, bool: lambda v: not v, str: lambda v: v + "x"}
    for name in MegaPodConfig.model_fields:
        if name not in deploy_cli.TOPOLOGY:
            value = getattr(CPU.megapod, name)
            pod = CPU.megapod.model_copy(update={name: changed[type(value)](value)})  # unchecked: "autox" is fine here
            assert profile_values(dataclasses.replace(CPU, megapod=pod)) == profile_values(CPU), name
    assert {"workers", "replicas", "grace_s", "attention_backend"} <= deploy_cli.TOPOLOGY.keys()
    assert not {"host", "worker_base_port", "llm_gpus", "snac_gpu", "restart_dead"} & deploy_cli.TOPOLOGY.keys()


def test_deploy_flags_parse_as_megapod_up_parses_them() -> None:
    args = deploy_cli.build_parser().parse_args([
        "--workers", "5", "--enforce-eager", "on", "--snac-max-wait-ms", "2.5", "--attention-backend", "FLASH_ATTN"])
    pod = deploy_cli.profile_from_args(args).megapod
    assert (pod.workers, pod.enforce_eager, pod.snac_max_wait_ms, pod.attention_backend) == (5, True, 2.5, "FLASH_ATTN")
    assert pod.replace(workers=7, enforce_eager=False, snac_max_wait_ms=5.0,
                       attention_backend="FLASHINFER") == H100.megapod  # nothing else moved
    for argv, message in ((["--enforce-eager", "maybe"], "--enforce-eager: Input should be a valid boolean"),
                          (["--workers", "x"], "--workers"), (["--workers", "0"], "--workers: Input should be greater")):
        with pytest.raises(ValueError, match=message):
            deploy_cli.profile_from_args(deploy_cli.build_parser().parse_args(argv))

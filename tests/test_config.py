"""Settings (orpheus_common/settings.py): every field of every command is its flag and its variable,
flags beat variables beat defaults, and bad values fail fast naming the flag or variable."""

import typing

import pytest

from llm_server.config import LlmServerConfig
from megapod.topology import MegaPodConfig
from orpheus_common.settings import Settings, as_text, flag
from orpheus_front.front import FrontConfig
from snac_server.config import SnacServerConfig

COMMANDS = [SnacServerConfig, LlmServerConfig, MegaPodConfig, FrontConfig]


def test_flags_override_env_and_parse_as_the_field_types():
    env = {"SNAC_MAX_BATCH": "8", "SNAC_DTYPE": "float16", "SNAC_FRAME_BUCKETS": "1,2"}
    config = SnacServerConfig.from_cli(["--max-batch", "64", "--cuda-graphs", "off", "--frame-buckets", "1,4,8"], env)
    assert config.max_batch == 64  # flag beats env
    assert config.dtype == "float16"  # env beats default
    assert config.cuda_graphs is False
    assert config.frame_buckets == (1, 4, 8)
    assert LlmServerConfig.from_cli(["--tokenizer", "None"], {}).tokenizer == "None"  # a string, as before


def test_only_the_command_line_reads_the_environment(monkeypatch):
    """A profile or a test builds its settings in code: the shell's MEGAPOD_* must not leak in."""
    monkeypatch.setenv("MEGAPOD_WORKERS", "5")
    assert MegaPodConfig().workers == 1 and MegaPodConfig(replicas=3).workers == 1
    assert MegaPodConfig.from_cli([]).workers == 5


# Values a field's type alone does not give (a rule ties it to another field), and the fields each
# value needs beside it.
SAMPLES = {"voices": (*LlmServerConfig.default("voices"), "extra"), "voice_aliases": "alloy=leo",
           "repetition_penalty": 1.3, "workers_dns": "llm.ns.svc:8000", "workers": "http://10.0.0.5:8000",
           "max_streams": 8, "max_streams_per_worker": 8, "min_streams_per_worker": 2,  # defaults None: the tier's
           "target_pace": 1.2, "admission_queue_s": 0.5, "codec_stall_timeout_s": 3.5, "max_num_seqs": 512, "max_num_batched_tokens": 1024, "async_scheduling": True,
           "enable_lora": True, "max_lora_rank": 64, "max_cpu_loras": 8,
           "max_cudagraph_capture_size": 512}
COMPANIONS = {"tls_cert": {"tls_key": "k"}, "tls_key": {"tls_cert": "c"}, "tls_client_ca": {"tls_cert": "c", "tls_key": "k"},
              "codec_tls_cert": {"codec_tls_key": "k", "codec_tls_ca": "ca"},
              "codec_tls_key": {"codec_tls_cert": "c", "codec_tls_ca": "ca"}, "codec_tls_server_name": {"codec_tls_ca": "ca"},
              "ssl_certfile": {"ssl_keyfile": "k"}, "ssl_keyfile": {"ssl_certfile": "c"},
              "ssl_ca_certs": {"ssl_certfile": "c", "ssl_keyfile": "k"}}
BASE = {FrontConfig: {"workers_dns": "llm.ns.svc:8000"}}


def _other_value(cls: type[Settings], name: str) -> object:
    """A valid value of the field that is not its default."""
    default, kind = cls.default(name), cls.model_fields[name].annotation
    if name in SAMPLES and (default is None or isinstance(SAMPLES[name], type(default))):
        return SAMPLES[name]
    if typing.get_origin(kind) is typing.Literal:
        return next(v for v in typing.get_args(kind) if v != default)
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default / 2 if default > 0 else 0.5
    if isinstance(default, tuple):
        return default[:1]
    return f"{default}x" if default else "x"


CASES = [pytest.param(cls, name, id=f"{cls.__name__}.{name}") for cls in COMMANDS for name in cls.model_fields]


@pytest.mark.parametrize("cls, name", CASES)
def test_every_field_is_a_flag_and_a_variable(cls: type[Settings], name: str):
    value = _other_value(cls, name)
    given = {**BASE.get(cls, {}), **COMPANIONS.get(name, {}), name: value}
    if (cls, name) == (FrontConfig, "workers"):
        given["workers_dns"] = ""  # the front takes one of the two
    flags = [text for field, v in given.items() for text in (flag(field), as_text(v))]
    env = {cls.env_name(field): as_text(v) for field, v in given.items()}
    by_flag, by_env = cls.from_cli(flags, {}), cls.from_cli([], env)
    assert getattr(by_flag, name) == value and by_env == by_flag
    assert getattr(cls(**given), name) == value  # and in code


def test_variables_are_spelled_as_users_have_them_in_their_manifests():
    assert [SnacServerConfig.env_name("max_batch"), LlmServerConfig.env_name("max_streams"),
            MegaPodConfig.env_name("snac_max_wait_ms"), FrontConfig.env_name("workers_dns")] == [
        "SNAC_MAX_BATCH", "ORPHEUS_MAX_STREAMS", "MEGAPOD_SNAC_MAX_WAIT_MS", "MEGAPOD_FRONT_WORKERS_DNS"]


@pytest.mark.parametrize(
    "argv, env, message",
    [
        (["--dtype", "float64"], {}, "--dtype: Input should be 'float32', 'float16' or 'bfloat16'"),
        (["--policy", "fastest"], {}, "--policy: Input should be 'streaming' or 'reference'"),
        (["--frame-buckets", "2,4"], {}, "must include 1"),
        (["--frame-buckets", "1,0"], {}, "--frame-buckets: Input should be greater than or equal to 1"),
        (["--max-batch", "0"], {}, "--max-batch: Input should be greater than or equal to 1"),
        (["--cuda-graphs", "maybe"], {}, "--cuda-graphs: Input should be a valid boolean"),
        (["--port", "http"], {}, "--port: Input should be a valid integer"),
        (["--tls-cert", "/c.pem"], {}, "tls_cert and tls_key go together"),
        ([], {"SNAC_MAX_WAIT_MS": "soon"}, "SNAC_MAX_WAIT_MS: Input should be a valid number"),
        (["--max-wait-ms", "soon"], {"SNAC_MAX_WAIT_MS": "2"}, "--max-wait-ms: Input should be a valid number"),
        (["--max-batchs", "8"], {}, "unrecognized arguments: --max-batchs"),
    ],
)
def test_bad_settings_are_refused_with_the_reason(argv, env, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        SnacServerConfig.from_cli(argv, env)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "snac-server" in err and message in err, err


def test_settings_are_frozen_and_replace_checks_again():
    config = SnacServerConfig()
    with pytest.raises(ValueError):
        config.max_batch = 4  # type: ignore[misc]
    assert config.replace(max_batch="4").max_batch == 4
    with pytest.raises(ValueError, match="max_batch"):
        config.replace(max_batch=0)
    with pytest.raises(ValueError, match="extra"):
        SnacServerConfig(max_batch_size=4)


def test_defaults_need_no_gpu_and_no_download():
    config = SnacServerConfig()
    assert config.model == "random-24khz"
    assert config.device == "auto" and config.dtype == "float32"


@pytest.mark.parametrize("tier, cls", [("llm", LlmServerConfig), ("snac", SnacServerConfig)])
def test_a_megapod_sets_real_tier_settings(tier: str, cls: type[Settings]):
    """MegaPodConfig's fields name the tier settings they are (topology.Sets); each is a field there."""
    settings = MegaPodConfig().tier_settings(tier)
    assert settings and settings.keys() <= cls.model_fields.keys()
    cls(**settings)  # and values it takes (ValidationError otherwise)

"""SnacServerConfig: flags and environment map one-to-one onto fields; bad values fail fast."""

import pytest

from snac_server.config import SnacServerConfig, snac_config_from_cli


def test_flags_override_env_and_parse_as_the_field_types(monkeypatch):
    monkeypatch.setenv("SNAC_MAX_BATCH", "8")
    monkeypatch.setenv("SNAC_DTYPE", "float16")
    config = snac_config_from_cli(["--max-batch", "64", "--cuda-graphs", "off", "--frame-buckets", "1,4,8"])
    assert config.max_batch == 64  # flag beats env
    assert config.dtype == "float16"  # env beats default
    assert config.cuda_graphs is False
    assert config.frame_buckets == (1, 4, 8)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dtype", "float64"], "dtype must be one of"),
        (["--policy", "fastest"], "fastest"),
        (["--frame-buckets", "2,4"], "must include 1"),
        (["--max-batch", "0"], "max_batch"),
        (["--cuda-graphs", "maybe"], "not a boolean"),
        (["--port", "http"], "invalid literal"),
    ],
)
def test_bad_settings_are_refused_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        snac_config_from_cli(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_defaults_need_no_gpu_and_no_download():
    config = SnacServerConfig()
    assert config.model == "random-24khz"
    assert config.device == "auto" and config.dtype == "float32"

"""PDRT_* environment: one typed place, bad values rejected with an actionable message."""

import pytest

from pdruntime.env import ConfigError, RuntimeEnv


def test_defaults_when_nothing_is_set():
    env = RuntimeEnv.from_environ({})
    assert env.attention_backend == "auto"
    assert env.max_kv_splits == 32
    assert env.transfer_timeout_s == 60.0


def test_values_are_parsed_and_typed():
    env = RuntimeEnv.from_environ({
        "PDRT_ATTENTION_BACKEND": "Triton",
        "PDRT_DECODE_TARGET_CTAS": "512",
        "PDRT_MAX_KV_SPLITS": "16",
        "PDRT_TRANSFER_TIMEOUT_S": "2.5",
    })
    assert (env.attention_backend, env.decode_target_ctas, env.max_kv_splits, env.transfer_timeout_s) == ("triton", 512, 16, 2.5)


@pytest.mark.parametrize("name,value,needle", [
    ("PDRT_DECODE_TARGET_CTAS", "lots", "not an integer"),
    ("PDRT_DECODE_TARGET_CTAS", "-1", "out of range"),
    ("PDRT_MAX_KV_SPLITS", "0", "out of range"),
    ("PDRT_ATTENTION_BACKEND", "cuda", "accepted: auto, triton, torch"),
    ("PDRT_TRANSFER_TIMEOUT_S", "soon", "not a number"),
    ("PDRT_WATCHDOG_TICK_S", "0", "out of range"),
])
def test_bad_values_name_the_variable_and_what_is_accepted(name, value, needle):
    with pytest.raises(ConfigError) as err:
        RuntimeEnv.from_environ({name: value})
    assert name in str(err.value) and needle in str(err.value) and "accepted" in str(err.value)


def test_config_redacts_the_kv_token(tmp_path, monkeypatch):
    monkeypatch.setenv("PDRT_KV_AUTH_TOKEN", "s3cret")
    env = RuntimeEnv.from_environ()
    cfg = env.as_config()
    assert "s3cret" not in repr(cfg)
    assert cfg["kv_auth_token"] == "<redacted>"
    assert cfg["process_env"]["PDRT_KV_AUTH_TOKEN"] == "<redacted>"
    assert env.resolve_kv_auth_token() == "s3cret"


def test_token_file_is_read_and_empty_file_rejected(tmp_path):
    f = tmp_path / "token"
    f.write_text("abc\n")
    assert RuntimeEnv.from_environ({"PDRT_KV_AUTH_TOKEN_FILE": str(f)}).resolve_kv_auth_token() == "abc"
    f.write_text("  ")
    with pytest.raises(ConfigError, match="is empty"):
        RuntimeEnv.from_environ({"PDRT_KV_AUTH_TOKEN_FILE": str(f)}).resolve_kv_auth_token()
    with pytest.raises(ConfigError, match="cannot be read"):
        RuntimeEnv.from_environ({"PDRT_KV_AUTH_TOKEN_FILE": str(tmp_path / "missing")}).resolve_kv_auth_token()

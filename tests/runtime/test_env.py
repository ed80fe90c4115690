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
    ("PDRT_ATTENTION_BACKEND", "cuda", "accepted: auto, triton, cpu, torch"),
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


@pytest.mark.parametrize("name,value,allow,reported", [
    ("PDRT_MAX_KV_SPLITS", "16", (), "16"),
    ("SGLANG_SM120_MMA_TARGET_CTAS", "512", (), "512"),           # the incident's variable, injected
    ("NCCL_IB_DISABLE", "1", (), "1"),
    ("CUDA_VISIBLE_DEVICES", "0,1", (), "0,1"),
    ("TORCH_CUDA_ARCH_LIST", "9.0", (), "9.0"),
    ("HF_HUB_OFFLINE", "1", (), None),                          # not a reported family ...
    ("HF_HUB_OFFLINE", "1", ("HF_HUB_OFFLINE",), "1"),          # ... unless allow-listed by name
    ("OMP_NUM_THREADS", "4", ("OMP_*",), "4"),                  # ... or by prefix
    ("HOME", "/root", ("OMP_*",), None),
    ("PDRT_KV_AUTH_TOKEN", "s3cret", (), "<redacted>"),
    ("SGLANG_API_KEY", "sk-1", (), "<redacted>"),
    ("NCCL_SECRET", "x", (), "<redacted>"),
    ("HF_TOKEN", "hf_abc", ("HF_*",), "<redacted>"),            # allow-listed, still redacted
    ("PDRT_KV_AUTH_TOKEN_FILE", "/var/run/kv/token", (), "/var/run/kv/token"),  # a path, not a secret
    ("TORCH_HUB_URL", "https://user:pw@hub.example/x", (), "https://<redacted>@hub.example/x"),
])
def test_env_report_families_allow_list_and_redaction(name, value, allow, reported):
    from pdruntime.env import env_report
    got = env_report({name: value, "PATH": "/bin"}, allow)
    assert got.get(name) == reported
    assert "PATH" not in got and ("s3cret" not in repr(got)) and ("pw@" not in repr(got))


def test_config_reports_the_env_the_process_sees(monkeypatch):
    monkeypatch.setenv("SGLANG_SM120_MMA_TARGET_CTAS", "512")  # as a webhook would inject it
    monkeypatch.setenv("PDRT_REPORT_ENV", "MY_SIDECAR_*, HF_HUB_OFFLINE")
    monkeypatch.setenv("MY_SIDECAR_MODE", "on")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SGLANG_PASSWORD", "hunter2")
    cfg = RuntimeEnv.from_environ().as_config()
    assert cfg["report_env"] == ["MY_SIDECAR_*", "HF_HUB_OFFLINE"]
    pe = cfg["process_env"]
    assert pe["SGLANG_SM120_MMA_TARGET_CTAS"] == "512" and pe["MY_SIDECAR_MODE"] == "on" and pe["HF_HUB_OFFLINE"] == "1"
    assert pe["SGLANG_PASSWORD"] == "<redacted>" and "hunter2" not in repr(cfg)
    assert list(pe) == sorted(pe)


@pytest.mark.parametrize("raw", ["A B", "1ABC", "A*B", "-x"])
def test_report_env_allow_list_rejects_what_is_not_a_name(raw):
    with pytest.raises(ConfigError, match="PDRT_REPORT_ENV item .* accepted: comma-separated"):
        RuntimeEnv.from_environ({"PDRT_REPORT_ENV": f"OK,{raw}"})

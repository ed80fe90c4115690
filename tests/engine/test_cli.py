"""`pdrt generate` prints the completion; bad input exits 2 with a message naming the problem."""

from __future__ import annotations

import pytest

from pdruntime.cli import build_parser, main
from pdruntime.engine import Engine, EngineConfig, SamplingParams


def test_generate_prints_the_greedy_completion(tiny, tiny_model, capsys):
    prompt = "The quick brown fox"
    want = Engine(tiny, EngineConfig()).generate(
        [tiny.tokenizer.encode(prompt)], SamplingParams(max_tokens=12, temperature=0))[0]
    assert main(["generate", prompt, "--model", tiny_model, "--max-tokens", "12", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    eos = tiny.tokenizer.eos_token_ids
    assert out == tiny.tokenizer.decode([t for t in want if t not in eos]) + "\n"


def test_generate_chat_uses_the_template(tiny, tiny_model, capsys):
    text = tiny.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    want = Engine(tiny, EngineConfig()).generate([tiny.tokenizer.encode(text)], SamplingParams(max_tokens=6, temperature=0))[0]
    assert main(["generate", "hi", "--chat", "--model", tiny_model, "--max-tokens", "6"]) == 0
    eos = tiny.tokenizer.eos_token_ids
    assert capsys.readouterr().out == tiny.tokenizer.decode([t for t in want if t not in eos]) + "\n"


@pytest.mark.parametrize("argv,match", [
    (["generate", ""], "prompt is empty"),
    (["generate", "x", "--max-tokens", "0"], "max_tokens=0"),
    (["generate", "x", "--temperature", "-1"], "temperature=-1.0"),
    (["generate", "x", "--max-tokens", "5000"], "exceeds the context limit of 2048"),
])
def test_generate_bad_input_exits_2(tiny_model, capsys, argv, match):
    assert main(argv + ["--model", tiny_model]) == 2
    err = capsys.readouterr().err
    assert "pdrt generate: error:" in err and match in err


def test_generate_missing_model(tmp_path, capsys):
    assert main(["generate", "x", "--model", str(tmp_path / "none.gguf")]) == 2
    assert "none.gguf does not exist" in capsys.readouterr().err


def test_pd_subcommands_share_the_entry_point():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert "generate" in sub.choices
    try:
        import pdruntime.server.commands  # noqa: F401
    except ImportError:
        pytest.skip("server commands not present")
    assert {"serve", "up", "chat"} <= set(sub.choices)

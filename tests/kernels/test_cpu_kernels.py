"""pdstack's native CPU kernels (kernels/cpu): quantised linear layers, paged decode attention, RoPE + KV store.

Each kernel is checked against a torch reference written independently of it: the linear kernel against the same
arithmetic done in float64 (activations quantised by the same rule, so the comparison is tight, not "close to
fp32"), the attention against the float64 oracle of kernels/reference.py with NaN-filled garbage pages.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from pdruntime.kernels.cpu import native
from pdruntime.kernels.cpu.attention import HeadShape, cpu_decode_attention, rope_store_kv
from pdruntime.kernels.cpu.quant import (PRE_NONE, PRE_RMSNORM, PRE_SWIGLU, Q4_1, Q8_0, QuantLinear, pack,
                                         quantize_q4_1, quantize_q8_0, unpack)
from pdruntime.kernels.reference import reference_decode_attention

pytestmark = pytest.mark.skipif(native.unavailable_reason() is not None,
                                reason=f"pdstack's CPU kernels cannot be built here: {native.unavailable_reason()}")


def _dequant(ql: QuantLinear) -> torch.Tensor:
    """W [N, K] float64 from the stored codes and scales by torch alone (not the kernel's own dequantiser)."""
    n, k = ql.out_features, ql.in_features
    q = unpack(ql.wq, ql.fmt).double()  # [N, nb, 32]
    if ql.fmt == Q4_1:
        return (q * ql.d.double()[..., None] + ql.m.double()[..., None]).reshape(n, k)
    return ((q - 128) * ql.d.double()[..., None]).reshape(n, k)


def _quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> dx * xq per block of 32 (dx = max|x| / 32767, round half to even), float64."""
    m, k = x.shape
    b = x.double().reshape(m, k // 32, 32).float()
    d = b.abs().amax(-1, keepdim=True) / 32767.0
    q = torch.where(d > 0, b * (1.0 / d), torch.zeros_like(b)).round()
    return (q.double() * d.double()).reshape(m, k)


def _reference(ql: QuantLinear, x: torch.Tensor, pre: int, norm=None, eps=1e-5) -> torch.Tensor:
    """What pdrt_quant_linear computes, in float64 from the same quantised activations. Q4_1's min term uses the
    exact fp32 block sums; Q8_0 has none."""
    k = ql.in_features
    if pre == PRE_RMSNORM:
        x = torch.nn.functional.rms_norm(x, (k,), norm, eps)
    elif pre == PRE_SWIGLU:
        x = torch.nn.functional.silu(x[:, :k]) * x[:, k:]
    w = _dequant(ql)
    xq = _quantized_activations(x)
    if ql.fmt == Q8_0:
        return xq @ w.T
    m = ql.m.double().repeat_interleave(32, dim=1)  # the min term sees x itself, the scale term x's quantisation
    return xq @ (w - m).T + x.double() @ m.T


@pytest.mark.parametrize("fmt, rows, k, n",
                         list(itertools.product((Q4_1, Q8_0), (1, 2, 3, 5), (32, 96, 576, 1024, 1600), (7, 40))))
def test_quant_linear_equals_its_float64_arithmetic(fmt, rows, k, n):
    """Every tile shape (rows 1..5, N not a multiple of the 4-row tile), both weight formats, and every layout
    case: blocks only in pairs (K=32, 96: a lone odd block), a group of 16 and a pair (576), whole groups (1024),
    and groups with pairs and a lone block after them (1600 = 50 blocks)."""
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    ql = QuantLinear.from_weight(torch.randn(n, k, generator=g), fmt, threads=2)
    x = torch.randn(rows, k, generator=g)
    got = ql.run(x).double()
    ref = _reference(ql, x, PRE_NONE)
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.parametrize("fmt", (Q4_1, Q8_0))
def test_pack_and_unpack_are_inverse(fmt):
    g = torch.Generator().manual_seed(2)
    for nb in (1, 2, 3, 16, 17, 18, 34, 50):
        codes = torch.randint(0, 16 if fmt == Q4_1 else 256, (5, nb, 32), generator=g, dtype=torch.uint8)
        wq = pack(codes, fmt)
        assert wq.shape == (5, nb * (16 if fmt == Q4_1 else 32))
        assert torch.equal(unpack(wq, fmt), codes)


def test_16_bit_activations_keep_fp32s_products():
    """The product is within ~1e-4 of the dequantised weight's fp32 product (int8 activations were ~1e-2)."""
    g = torch.Generator().manual_seed(11)
    w, x = torch.randn(64, 576, generator=g), torch.randn(1, 576, generator=g)
    ql = QuantLinear.from_weight(w, Q4_1)
    ref = x.double() @ _dequant(ql).T
    assert float((ql.run(x).double() - ref).abs().max() / ref.abs().max()) < 1e-4


@pytest.mark.parametrize("fmt", (Q4_1, Q8_0))
def test_pre_ops_and_accumulate(fmt):
    g = torch.Generator().manual_seed(5)
    ql = QuantLinear.from_weight(torch.randn(24, 64, generator=g), fmt, threads=2)
    x, norm = torch.randn(3, 64, generator=g), torch.rand(64, generator=g) + 0.5
    got = ql.run(x, pre=PRE_RMSNORM, norm=norm, eps=1e-5).double()
    ref = _reference(ql, x, PRE_RMSNORM, norm)
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
    gu = torch.randn(3, 128, generator=g)
    ref = _reference(ql, gu, PRE_SWIGLU)
    resid = torch.randn(3, 24, generator=g)
    out = resid.clone()
    assert ql.run(gu, pre=PRE_SWIGLU, out=out, accumulate=True) is out
    assert ((out.double() - resid.double()) - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_many_rows_take_the_exact_dequantised_weight():
    """Past KERNEL_MAX_ROWS (prefill chunks) the weight is dequantised for BLAS: no activation quantisation."""
    g = torch.Generator().manual_seed(9)
    ql = QuantLinear.from_weight(torch.randn(16, 64, generator=g), Q4_1)
    x = torch.randn(100, 64, generator=g)
    ref = x.double() @ _dequant(ql).T
    assert (ql(x).double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert torch.equal(ql.dequantized(), _dequant(ql).float())


def test_shapes_the_kernel_cannot_take_are_refused():
    with pytest.raises(ValueError, match="in_features divisible by 32"):
        QuantLinear.from_weight(torch.zeros(4, 48), Q4_1)
    ql = QuantLinear.from_weight(torch.zeros(4, 64), Q4_1)
    with pytest.raises(AssertionError, match="64 inputs"):
        ql.run(torch.zeros(1, 32))


def test_gguf_blocks_come_back_exactly():
    """Re-quantising the embedded SmolLM2 GGUF's dequantised tensors gives back the file's own Q4_1 and Q8_0 blocks:
    int4 serves the file's weights, not a second rounding of them."""
    from pdruntime.model.config import default_model_path
    from pdruntime.model.gguf_loader import _parse, dequantize

    path = default_model_path()
    _, infos, data = _parse(path)
    checked = set()
    for t in infos:
        if t.type_name not in ("Q4_1", "Q8_0") or t.type_name in checked:
            continue
        checked.add(t.type_name)
        k, n = int(t.shape[0]), int(np.prod(t.shape[1:]))
        raw = np.asarray(data[t.offset: t.offset + t.nbytes]).reshape(n, k // 32, -1)
        w = torch.from_numpy(dequantize(raw.reshape(-1), t.type_name, n * k).copy()).view(n, k)
        d_file = torch.from_numpy(raw[..., 0:2].copy().view(np.float16)[..., 0])
        if t.type_name == "Q4_1":
            codes, d, m = quantize_q4_1(w)
            assert torch.equal(m, torch.from_numpy(raw[..., 2:4].copy().view(np.float16)[..., 0]))
            nibbles = torch.from_numpy(raw[..., 4:].copy())
            assert torch.equal(codes, torch.cat([nibbles & 15, nibbles >> 4], dim=-1))
        else:
            codes, d = quantize_q8_0(w)
            q_file = torch.from_numpy(raw[..., 2:].copy().view(np.int8)).to(torch.int16) + 128
            assert torch.equal(codes, q_file.to(torch.uint8))
        assert torch.equal(d, d_file)
    assert checked == {"Q4_1", "Q8_0"}


# ---------------------------------------------------------------- attention

@pytest.mark.parametrize("lens, group, head_dim, page", [
    ([1], 3, 64, 16), ([700], 3, 64, 16), ([5, 33, 17], 4, 32, 4), ([2500, 1, 300], 3, 64, 16),
    ([40, 513], 2, 128, 16), ([9, 1000], 1, 16, 7), ([3000], 8, 64, 16),
])
def test_paged_attention_matches_float64_oracle(lens, group, head_dim, page, paged_case, rel_err):
    """Pages scattered, NaN in every slot no sequence owns, head dims on the vector path (32/64/128) and off it (16),
    a single long sequence (cut into spans and merged), page sizes that do not divide the lengths."""
    q, k, v, bt, seq_lens = paged_case(lens, num_kv_heads=3, group=group, head_dim=head_dim, page=page, seed=len(lens))
    for threads in (1, 2):
        out = cpu_decode_attention(q, k, v, bt, seq_lens, threads=threads)
        assert rel_err(out, reference_decode_attention(q, k, v, bt, seq_lens)) <= 2e-5


def test_a_sequence_shorter_than_its_spans_takes_nothing_from_uninitialised_memory(paged_case, rel_err):
    """A sequence of one token among long ones is cut into as many spans as they are, and all but the first are
    empty: their accumulators are never written. The merge must skip them, not weight them by 0 (0 x NaN is NaN).
    glibc hands a freed chunk of the same size to the kernel's next malloc, so a chunk filled with NaN and freed
    just before the call is what the span buffers start as: before the fix this failed every time, and it was the
    rare failure of test_paged_attention_matches_float64_oracle[lens3-3-64-16] when an earlier test's NaN-padded
    caches had been freed there."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    q, k, v, bt, seq_lens = paged_case([2500, 1, 300], num_kv_heads=3, group=3, head_dim=64, page=16, seed=3)
    ref = reference_decode_attention(q, k, v, bt, seq_lens)
    out = torch.empty_like(q)  # allocated before the poisoned chunk: the kernel's own malloc is the next one
    items, per = 3 * 2, 9 * (64 + 2)  # 3 sequences x 2 spans at 2 threads; per item: 9 heads x (acc + max + sum)
    size = 4 * (items * per + 2 * 9 * 64)  # + each thread's scaled-q scratch: the kernel's one buffer, in bytes
    for _ in range(5):
        chunk = libc.malloc(size)
        ctypes.memset(chunk, 0xFF, size)  # every float a NaN
        libc.free(chunk)
        cpu_decode_attention(q, k, v, bt, seq_lens, out=out, threads=2)
        assert rel_err(out, ref) <= 2e-5


def test_attention_reads_q_inside_qkv_rows(paged_case, rel_err):
    """The int4 decode path hands q as a view into each qkv row (rows strided by the whole qkv width)."""
    q, k, v, bt, seq_lens = paged_case([50, 7], num_kv_heads=3, group=3, head_dim=64, page=16, seed=3)
    qkv = torch.randn(2, (9 + 6) * 64)
    qkv[:, : 9 * 64] = q.reshape(2, -1)
    view = qkv[:, : 9 * 64].view(2, 9, 64)
    assert not view.is_contiguous()
    assert rel_err(cpu_decode_attention(view, k, v, bt, seq_lens), reference_decode_attention(q, k, v, bt, seq_lens)) <= 2e-5


def test_rope_store_kv_matches_the_model():
    """RoPE + KV store in C against the model's own rotate-half formula and a plain index_copy_."""
    from pdruntime.model.config import LlamaConfig
    from pdruntime.model.llama import _rotate, rope_cos_sin

    cfg = LlamaConfig(vocab_size=10, hidden_size=128, intermediate_size=64, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=32, max_position_embeddings=64)
    cos, sin = rope_cos_sin(cfg, 64)
    sin_signed = torch.cat((-sin[:, :16], sin[:, 16:]), dim=-1)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(3, (4 + 4) * 32, generator=g)
    pos = torch.tensor([0, 17, 63])
    slots = torch.tensor([5, 0, 11])
    kc, vc = torch.zeros(4, 4, 2, 32), torch.zeros(4, 4, 2, 32)
    expect = _rotate(qkv[:, : 6 * 32].view(3, 6, 32), cos[pos][:, None], sin_signed[pos][:, None])
    v = qkv[:, 6 * 32:].view(3, 2, 32).clone()
    rope_store_kv(qkv, HeadShape(4, 2, 32), pos, slots, (cos, sin_signed), (kc, vc))
    assert torch.allclose(qkv[:, : 6 * 32].view(3, 6, 32), expect, atol=1e-6)
    assert torch.equal(kc.view(-1, 2, 32)[slots], qkv[:, 4 * 32: 6 * 32].view(3, 2, 32))
    assert torch.equal(vc.view(-1, 2, 32)[slots], v)
    assert kc.view(-1, 2, 32)[[1, 2, 3]].abs().sum() == 0  # nothing else written


# ---------------------------------------------------------------- the model

def test_int4_decode_follows_fp32_on_the_tiny_model(tiny_model):
    """int4 decode (fused norms, RoPE in C, accumulate into the residual) against the fp32 model holding the same
    4-bit weights dequantised, logits step by step: what is left is the 16-bit activations and summation order."""
    from pdruntime.engine.kv_cache import KVCache
    from pdruntime.model import load_model

    ref, q4 = load_model(tiny_model), load_model(tiny_model, weights="int4")
    assert q4.info.weights == "int4" and q4.model.attention_backend.endswith("[cpu]")
    with torch.no_grad():
        for lr, lq in zip(ref.model.layers, q4.model.layers):
            for name in ("qkv", "o", "gate_up", "down"):
                getattr(lr, name).weight.copy_(_dequant(getattr(lq, name)).float())
        ref.model.lm_head.weight = torch.nn.Parameter(_dequant(q4.model.lm_head).float(), requires_grad=False)
    ref.model._decode_layers = None
    c = ref.model.config
    ids = [3, 17, 42, 9, 100, 5, 77, 31, 8, 64]
    logits = {}
    for name, m in (("fp32", ref.model), ("int4", q4.model)):
        kv = KVCache(c.num_layers, 2, 16, c.num_kv_heads, c.head_dim, dtype=torch.float32)
        table = torch.arange(2, dtype=torch.int32)[None, :]
        with torch.inference_mode():
            logits[name] = torch.stack([m.decode(torch.tensor([t]), torch.tensor([i]), kv.k, kv.v, table,
                                                 torch.tensor([i + 1], dtype=torch.int32))[0] for i, t in enumerate(ids)])
    cos = torch.nn.functional.cosine_similarity(logits["fp32"], logits["int4"], dim=-1)
    assert cos.min() > 0.9999, cos
    assert torch.equal(logits["fp32"].argmax(-1), logits["int4"].argmax(-1))


def test_without_a_compiler_int4_is_refused_and_attention_falls_back(tmp_path, tiny_model):
    """No C compiler (an empty PATH) and no cached build: int4 is refused saying why, auto attention takes torch."""
    code = ("from pdruntime.model import load_model, ModelLoadError\n"
            f"m = load_model({str(tiny_model)!r})\n"
            "print('backend', m.model.attention_backend)\n"
            "try:\n"
            f"    load_model({str(tiny_model)!r}, weights='int4')\n"
            "except ModelLoadError as exc:\n"
            "    print('refused', exc)\n")
    env = {**os.environ, "PATH": str(tmp_path), "HOME": str(tmp_path), "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "backend kernels.decode_attention[torch]" in out.stdout
    assert "refused weights='int4' needs pdstack's CPU kernels" in out.stdout and "no C compiler" in out.stdout


def test_auto_weights_pick_int4_on_the_cpu_and_fp32_elsewhere(tiny_model):
    from pdruntime.model import load_model
    from pdruntime.model.loader import _auto_weights

    assert load_model(tiny_model, weights="auto").info.weights == "int4"
    m = load_model(tiny_model).model
    assert _auto_weights(m, torch.bfloat16, torch.device("cpu")) == "fp32"
    assert _auto_weights(m, torch.float32, torch.device("cuda")) == "fp32"


def test_auto_weights_leave_int4_out_where_the_kernels_are_the_portable_build(tiny_model, monkeypatch, caplog):
    """A CPU without AVX-512 VNNI gets the kernels' portable build, which decodes int4 ~3x slower than fp32
    (docs/benchmarks.md): auto takes fp32 there; an explicit int4 still loads, with a warning saying so."""
    import logging

    from pdruntime.kernels.cpu import native
    from pdruntime.model import load_model
    from pdruntime.model.loader import _auto_weights

    m = load_model(tiny_model).model
    assert _auto_weights(m, torch.float32, torch.device("cpu")) == ("int4" if native.simd_level() == native.VNNI
                                                                     else "fp32")
    monkeypatch.setattr(native, "simd_level", lambda: "portable")
    assert _auto_weights(m, torch.float32, torch.device("cpu")) == "fp32"
    assert load_model(tiny_model, weights="auto").info.weights == "float32"
    with caplog.at_level(logging.WARNING, logger="pdruntime.model"):
        assert load_model(tiny_model, weights="int4").info.weights == "int4"
    assert any("portable int4 kernels" in r.getMessage() for r in caplog.records)


def test_int4_from_the_gguf_blocks_equals_quantising_the_dequantised_model():
    """pdrt up's int4 start-up path (the GGUF's blocks taken as they are) holds the same bytes as quantize_int4 over
    the dequantised fp32 model, layer by layer and for the head; and decodes the same logits."""
    from pdruntime.engine.kv_cache import KVCache
    from pdruntime.model import load_model

    direct = load_model(weights="int4")
    requant = load_model()
    requant.model.quantize_int4()
    pairs = [(direct.model.lm_head, requant.model.lm_head)]
    for a, b in zip(direct.model.layers, requant.model.layers):
        pairs += [(getattr(a, n), getattr(b, n)) for n in ("qkv", "o", "gate_up", "down")]
        assert torch.equal(a.input_norm, b.input_norm) and torch.equal(a.post_norm, b.post_norm)
    for a, b in pairs:
        assert a.fmt == b.fmt and torch.equal(a.wq, b.wq) and torch.equal(a.d, b.d)
        assert (a.m is None and b.m is None) or torch.equal(a.m, b.m)
    assert torch.equal(direct.model.embed, requant.model.embed)
    c = direct.model.config
    outs = []
    for m in (direct.model, requant.model):
        kv = KVCache(c.num_layers, 1, 16, c.num_kv_heads, c.head_dim, dtype=torch.float32)
        with torch.inference_mode():
            outs.append(m.decode(torch.tensor([42]), torch.tensor([0]), kv.k, kv.v,
                                 torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1], dtype=torch.int32)))
    assert torch.equal(outs[0], outs[1])

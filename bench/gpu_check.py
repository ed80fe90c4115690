#!/usr/bin/env python
"""One prepared GPU check (``make gpu-check``): prints one table, < 8 minutes on one GPU.

    python bench/gpu_check.py                      # on a GPU host
    python bench/gpu_check.py --device cpu --smoke # tiny shapes on the CPU: checks the script itself

Rows:
  gpu tests        ``pytest -m gpu`` (engine bf16 vs fp32, Triton == torch, CUDA graphs on/off, TP over NCCL,
                   PD with KV on the GPU, wire bf16 pages): passed / failed / skipped
  bf16 vs fp32     the engine in bf16 on CUDA against fp32 on the CPU, same seeded random model: worst
                   relative logit error, greedy agreement where fp32's top-2 margin is clear
  decode b=1/16/64 decode tokens/s on a random-weight Llama-3-8B-shaped model (bf16, CUDA graphs), next to
                   HF transformers (same weights, same batch, same run) and the HBM roofline: weight bytes +
                   KV bytes read per step, divided by the device-to-device copy bandwidth measured here
  attention        decode-attention kernel bandwidth (bench/decode_attention_gpu.py) as % of copy bandwidth

Without a CUDA device it prints why and exits 0, recording nothing. Models are seeded random weights built
in memory (no downloads, no files: a GPU host may have no package index and little disk).
Python packages beyond torch and triton: transformers (the peer), numpy, safetensors, tokenizers, jinja2,
pytest, pytest-asyncio, pytest-timeout, httpx, fastapi, uvicorn, prometheus-client, pydantic, pyyaml
(all in ``pip install -e '.[runtime,dev]'``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEEDS = ("transformers", "numpy", "safetensors", "tokenizers", "jinja2", "pytest", "httpx", "fastapi", "uvicorn")


@dataclass(frozen=True)
class Shape:
    """A Llama architecture, without a checkpoint."""

    name: str
    vocab: int
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    max_pos: int


LLAMA3_8B = Shape("Llama-3-8B", 128256, 4096, 14336, 32, 32, 8, 8192)
SMOKE = Shape("tiny", 2048, 256, 688, 2, 4, 2, 2048)


def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the file executes
    spec.loader.exec_module(mod)
    return mod


# ---- models ---------------------------------------------------------------------------------------

def hf_model(shape: Shape, dtype: torch.dtype, device: str, seed: int = 0):
    """HF LlamaForCausalLM with seeded random weights (init std 1/sqrt(hidden)), built on the device."""
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    cfg = HFConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.inter,
                   num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                   head_dim=shape.hidden // shape.heads, max_position_embeddings=shape.max_pos, rope_theta=500000.0,
                   tie_word_embeddings=False, initializer_range=shape.hidden ** -0.5)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def pdstack_engine(hf, shape: Shape, config):
    """pdstack's engine on the same weights as ``hf`` (copied tensor by tensor into the fused layout)."""
    from pdruntime.engine import Engine
    from pdruntime.model.config import LlamaConfig
    from pdruntime.model.llama import LlamaModel, resolve_decode_attention
    from pdruntime.model.loader import LoadedModel, ModelInfo

    cfg = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.inter,
                      num_layers=shape.layers, num_heads=shape.heads, num_kv_heads=shape.kv_heads,
                      head_dim=shape.hidden // shape.heads, max_position_embeddings=shape.max_pos,
                      rope_theta=500000.0, tie_word_embeddings=False)
    model = LlamaModel(cfg, dtype=config.torch_dtype, device=config.device)
    model.load_hf_state(hf.state_dict())
    model.decode_attention, model.attention_backend = resolve_decode_attention(config.device)
    info = ModelInfo(name=f"random-{shape.name}", path="<memory>", sha256="", num_layers=cfg.num_layers,
                     num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                     hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                     max_position_embeddings=cfg.max_position_embeddings, dtype=config.dtype, source_format="random")
    return Engine(LoadedModel(model=model, tokenizer=_json_tokenizer(), info=info), config)


def _json_tokenizer():
    """The in-process BPE tokenizer of pdruntime.model.testing, through the runtime's own loader."""
    import tempfile

    from pdruntime.model.testing import CHAT_TEMPLATE, build_tokenizer
    from pdruntime.model.tokenizer import tokenizer_from_json

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "tokenizer.json")
        build_tokenizer().save(path)
        return tokenizer_from_json(path, {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"}, [2])


# ---- measurements ---------------------------------------------------------------------------------

def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def prompts(batch: int, length: int, vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


def pdstack_decode_tps(engine, batch: int, prompt_len: int, new_tokens: int) -> tuple[float, float]:
    """(decode tokens/s, mean context) of ``batch`` sequences: prefill first, then time the decode steps only."""
    from pdruntime.engine import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts(batch, prompt_len, engine.model.config.vocab_size)):
        engine.add_request(f"b{batch}-{i}", p, params)
    started = set()
    while len(started) < batch:  # prefill (chunked) until every sequence has its first token
        for out in engine.step():
            started.add(out.request_id)
    _sync(engine.config.device)
    t0, n = time.perf_counter(), 0
    while engine.has_work():
        n += sum(len(o.new_token_ids) for o in engine.step())
    _sync(engine.config.device)
    return n / (time.perf_counter() - t0), prompt_len + new_tokens / 2


def hf_decode_tps(hf, batch: int, prompt_len: int, new_tokens: int, device: str) -> float:
    """HF generate, greedy, decode-only rate: (time(new_tokens) - time(1 token)) over new_tokens - 1 steps."""
    ids = torch.tensor(prompts(batch, prompt_len, hf.config.vocab_size), device=device)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def run(n: int) -> float:
        _sync(device)
        t = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        _sync(device)
        return time.perf_counter() - t

    run(2)  # warm-up
    return batch * (new_tokens - 1) / max(1e-9, run(new_tokens) - run(1))


def roofline_tps(shape: Shape, batch: int, context: float, elem_bytes: int, copy_bw: float, weight_bytes: int) -> float:
    """Upper bound: every step reads all weights once plus every sequence's K/V; at copy bandwidth."""
    kv = 2 * shape.layers * shape.kv_heads * (shape.hidden // shape.heads) * elem_bytes * context * batch
    return batch * copy_bw / (weight_bytes + kv)


def bf16_vs_fp32(device: str, smoke: bool) -> tuple[float, int, int, bool]:
    """(worst rel err, clear positions, agreeing clear positions, greedy all equal) of the engine in bf16 on
    ``device`` vs fp32 on the CPU, teacher-forced on a seeded random model."""
    from pdruntime.engine import EngineConfig

    shape = SMOKE if smoke else Shape("check", 8192, 1024, 2816, 4, 8, 2, 4096)
    hf = hf_model(shape, torch.float32, "cpu", seed=3)
    ref_engine = pdstack_engine(hf, shape, EngineConfig(num_blocks=64, block_size=16))
    low = pdstack_engine(hf, shape, EngineConfig(num_blocks=64, block_size=16, device=device, dtype="bf16"))
    ids = prompts(4, 48, shape.vocab, seed=9)
    outs = []
    for eng in (ref_engine, low):
        rows = []
        with torch.inference_mode():
            for i, p in enumerate(ids):
                blocks = torch.arange(i * 4, i * 4 + 4)
                rows.append(eng.model.prefill(torch.tensor(p), 0, eng.kv.k, eng.kv.v, blocks, all_logits=True).cpu())
        outs.append(torch.stack(rows))
    ref, got = outs
    scale = ref.abs().amax(-1)
    rel = float(((got - ref).abs().amax(-1) / scale).max())
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * 0.05 * scale
    agree = int((got.argmax(-1)[clear] == ref.argmax(-1)[clear]).sum())
    return rel, int(clear.sum()), agree, bool(torch.equal(got.argmax(-1), ref.argmax(-1)))


def gpu_tests(timeout_s: int) -> str:
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", os.path.join(ROOT, "tests")]
    try:
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"TIMEOUT after {timeout_s}s"
    tail = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else res.stderr[-200:]
    if res.returncode not in (0, 5):
        print(res.stdout[-4000:], file=sys.stderr)
    return re.sub(r"=+", "", tail).strip()


# ---- main -----------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --smoke: check the script)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; with --device cpu runs anywhere")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--skip-tests", action="store_true", help="do not run the gpu-marked tests")
    ap.add_argument("--tests-timeout-s", type=int, default=240)
    args = ap.parse_args(argv)
    missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        print(f"gpu_check: missing Python packages {missing}; install with pip install -e '.[runtime,dev]'")
        return 2
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (torch.cuda.is_available() is False): nothing measured, nothing "
              "recorded. Run it on a GPU host (`make gpu-check`), or check the script with --device cpu --smoke.")
        return 0
    if not cuda and not args.smoke:
        print("gpu_check: --device cpu only with --smoke (tiny shapes); the real check needs a GPU")
        return 2
    device = "cuda:0" if cuda else "cpu"
    t_start = time.perf_counter()
    from pdruntime.engine import EngineConfig

    attn = _bench_module("decode_attention_gpu")
    copy_bw = attn.copy_bandwidth("cuda" if cuda else "cpu", (1 << 30) if cuda else (64 << 20))
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(f"gpu_check on {name}; torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"copy bandwidth {copy_bw / 1e9:.1f} GB/s (read + write)")
    rows: list[tuple[str, str, str, str, str]] = []  # (check, pdstack, peer, bound / target, verdict)

    if args.skip_tests:
        rows.append(("gpu tests", "skipped (--skip-tests)", "", "", ""))
    else:
        summary = gpu_tests(args.tests_timeout_s)
        ok = "failed" not in summary and "error" not in summary and "TIMEOUT" not in summary
        rows.append(("gpu tests (pytest -m gpu)", summary, "", "all pass", "ok" if ok else "FAIL"))

    rel, clear, agree, all_eq = bf16_vs_fp32(device, args.smoke)
    rows.append(("bf16 (%s) vs fp32 cpu logits" % device, f"max rel err {rel:.4f}", "", "<= 0.05",
                 "ok" if rel <= 0.05 else "FAIL"))
    rows.append(("greedy where top-2 margin clear", f"{agree}/{clear} agree", "", f"all (all positions equal: {all_eq})",
                 "ok" if agree == clear else "FAIL"))

    shape = SMOKE if args.smoke else LLAMA3_8B
    dtype = torch.bfloat16 if cuda else torch.float32
    hf = hf_model(shape, dtype, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    cfg = EngineConfig(device=device, dtype="bf16" if cuda else "fp32", cuda_graphs=cuda, max_num_seqs=max(args.batches),
                       max_model_len=min(shape.max_pos, args.prompt_len + args.new_tokens + 16),
                       max_prefill_tokens=4096)
    engine = pdstack_engine(hf, shape, cfg)
    print(f"decode model: random {shape.name} ({weight_bytes / 2**30:.1f} GiB {dtype}), prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens; pdstack cuda_graphs: {engine.graphs_status}")
    for b in args.batches:
        ours, ctx = pdstack_decode_tps(engine, b, args.prompt_len, args.new_tokens)
        peer = hf_decode_tps(hf, b, args.prompt_len, args.new_tokens, device)
        bound = roofline_tps(shape, b, ctx, dtype.itemsize, copy_bw, weight_bytes)
        rows.append((f"decode tok/s b={b}", f"{ours:,.0f} ({100 * ours / bound:.0f}% of roofline)",
                     f"HF {peer:,.0f} (x{ours / peer:.2f})", f"roofline {bound:,.0f}", ""))
    del engine, hf
    if cuda:
        torch.cuda.empty_cache()

    from pdruntime.env import RuntimeEnv
    from pdruntime.kernels.decode_attention import KernelConfig

    if cuda:
        kcfg = KernelConfig.from_env(RuntimeEnv.from_environ(), "cuda")
        ashape, contexts, batches = attn.Shape(), [1024, 8192, 32768], [1, 8, 64]
    else:
        kcfg = KernelConfig.from_env(RuntimeEnv(attention_backend="torch"), "cpu")
        ashape, contexts, batches = attn.Shape(num_q_heads=6, num_kv_heads=2, head_dim=64, dtype=torch.float32), [300], [1, 3]
    for r in attn.bench(contexts, batches, ashape, "cuda" if cuda else "cpu", kcfg, 0.8):
        label = f"attention b={r['batch']} ctx={r['context']}"
        if "pdstack" not in r:
            rows.append((label, r.get("note", "-"), "", "", ""))
            continue
        peer = f"sdpa {r['sdpa'] / 1e9:.0f} GB/s" if "sdpa" in r else r.get("sdpa_note", "")
        share = r["pdstack"] / copy_bw
        target = r["context"] >= 8192
        rows.append((label, f"{r['pdstack'] / 1e9:.0f} GB/s ({100 * share:.0f}% of copy)", peer,
                     ">= 85% of copy" if target else "", ("ok" if share >= 0.85 else "below") if target and cuda else ""))

    widths = [max(len(r[i]) for r in rows + [("check", "pdstack", "peer", "bound / target", "verdict")]) for i in range(5)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    print(line(("check", "pdstack", "peer", "bound / target", "verdict")))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))
    fails = [r for r in rows if r[4] == "FAIL"]
    print(f"gpu_check: {len(rows)} rows, {len(fails)} failed, wall time {time.perf_counter() - t_start:.0f} s"
          + (" (smoke: tiny shapes on cpu, figures are not a GPU result)" if not cuda else ""))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())

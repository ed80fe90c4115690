"""What each weight format costs in accuracy against fp32, on the default model and fixed prompts.

    .venv/bin/python bench/weights_accuracy.py [--new-tokens 48] [--weights fp32 int4 int8 bf16]

For each of bench/decode_cpu.py's 16 prompts: fp32 greedy-continues it by --new-tokens tokens and scores that
token sequence in one teacher-forced prefill (the reference logits); then every format scores the same sequence
teacher-forced one decode step per token, the path every generated token takes (int4 quantises decode's
activations; its long prefills dequantise the weights instead, so a prefill would not show that cost). The fp32
row is fp32's own decode against its prefill: the floor that summation order alone leaves. Reported per format:
**top-1 agreement** (positions whose argmax equals fp32's, over every position of every sequence), the **worst
logit error** (max |logit - fp32 logit| over every position and vocabulary entry) and that error relative to the
fp32 logits' range at its position, and how many of the 16 greedy continuations are token-for-token fp32's.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_cpu import FORMATS, PROMPTS, engine_for, load_format  # noqa: E402


def all_logits(loaded, ids: list[int]) -> torch.Tensor:
    """fp32 logits [len(ids), V] of every position, teacher-forced, by one prefill (the reference's scoring)."""
    from pdruntime.engine.kv_cache import KVCache

    c = loaded.model.config
    pages = -(-len(ids) // 16)
    kv = KVCache(c.num_layers, pages, 16, c.num_kv_heads, c.head_dim, dtype=loaded.model.embed.dtype)
    with torch.inference_mode():
        return loaded.model.prefill(torch.tensor(ids), 0, kv.k, kv.v, torch.arange(pages), all_logits=True).float()


def decode_logits(loaded, ids: list[int]) -> torch.Tensor:
    """fp32 logits [len(ids), V] of every position, teacher-forced, one decode step per token: the numerics of
    every generated token (int4 quantises decode's activations; a long prefill dequantises the weights instead,
    so scoring by prefill would not see that)."""
    from pdruntime.engine.kv_cache import KVCache

    m, c = loaded.model, loaded.model.config
    pages = -(-len(ids) // 16)
    kv = KVCache(c.num_layers, pages, 16, c.num_kv_heads, c.head_dim, dtype=m.embed.dtype)
    table = torch.arange(pages, dtype=torch.int32)[None, :]
    out = []
    with torch.inference_mode():
        for pos, tok in enumerate(ids):
            out.append(m.decode(torch.tensor([tok]), torch.tensor([pos]), kv.k, kv.v, table,
                                torch.tensor([pos + 1], dtype=torch.int32))[0].float())
    return torch.stack(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--weights", nargs="+", default=["fp32", "int4", "int8", "bf16"], choices=FORMATS,
                    help="bf16: --dtype bf16 (the GGUF dequantised to bf16, bf16 KV cache)")
    ap.add_argument("--model", default=None, help="GGUF path (default: the embedded SmolLM2)")
    args = ap.parse_args()
    from pdruntime.engine import SamplingParams
    from pdruntime.model import default_model_path, load_model

    path = args.model or default_model_path()
    ref = load_model(path)
    prompts = [ref.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    conts = engine_for(ref, "fp32", 16).generate(prompts, params)
    seqs = [p + c for p, c in zip(prompts, conts)]
    ref_logits = [all_logits(ref, s) for s in seqs]
    print(f"model: {os.path.basename(path)} | {len(seqs)} prompts + {args.new_tokens} fp32 greedy tokens each, "
          f"{sum(len(s) for s in seqs)} positions scored\n")
    print("| weights | top-1 agreement | worst logit error | relative to fp32's logit range | greedy continuations "
          "equal to fp32's |")
    print("|---|---:|---:|---:|---:|")
    for w in args.weights:
        q = load_format(path, w)
        agree = total = 0
        worst = worst_rel = 0.0
        for s, rl in zip(seqs, ref_logits):
            ql = decode_logits(q, s)
            agree += int((ql.argmax(-1) == rl.argmax(-1)).sum())
            total += len(s)
            err = (ql - rl).abs().amax(-1)
            worst = max(worst, float(err.max()))
            worst_rel = max(worst_rel, float((err / (rl.amax(-1) - rl.amin(-1))).max()))
        same = sum(c == o for c, o in zip(conts, engine_for(q, w, 16).generate(prompts, params)))
        print(f"| {w} | {100 * agree / total:.2f}% | {worst:.3f} | {100 * worst_rel:.2f}% | {same} / {len(seqs)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

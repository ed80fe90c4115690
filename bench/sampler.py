"""Sampler cost: 64 rows of sampled decoding vs greedy, per step, on the default model (or --model).

Prints two tables:
1. sampler alone on [64, V] logits: greedy argmax, the batched sampler (T/top-k/top-p/min-p/penalties), the
   previous per-row sampler (a full 49k sort per row, one row at a time) as the peer, and structured output
   (an llguidance JSON-schema bitmask per row);
2. decode steps of the engine with 64 running sequences, paired: every step is timed and, on the logits it
   sampled, every sampler configuration too, so step = forward + that sampler; ratio to greedy (the issue's
   bar: sampled <= 1.10x greedy).

    .venv/bin/python bench/sampler.py [--model PATH] [--rows 64] [--steps 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdruntime.engine import Engine, EngineConfig, SamplingParams
from pdruntime.engine.sampler import Row, sample_batch

SAMPLED = dict(temperature=0.8, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.2,
               presence_penalty=0.1)
TOP_P_ONLY = dict(temperature=0.2, top_p=0.9, repetition_penalty=1.1)  # SmolLM2's defaults
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def per_row_sort(logits: torch.Tensor, params: list[SamplingParams], gens) -> list[int]:
    """The sampler before this change: per row, a full sort of the vocabulary (the peer)."""
    out = []
    for row, p, g in zip(logits, params, gens):
        scaled = row / p.temperature
        vals, idx = torch.topk(scaled, p.top_k) if p.top_k else torch.sort(scaled, descending=True)
        probs = torch.softmax(vals, -1)
        if p.top_p < 1:
            cum = torch.cumsum(probs, -1)
            probs = torch.where((cum - probs) < p.top_p, probs, torch.zeros_like(probs))
        out.append(int(idx[torch.multinomial(probs, 1, generator=g)]))
    return out


def timed(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def sampler_table(vocab: int, rows: int, reps: int, engine: Engine | None) -> None:
    torch.manual_seed(0)
    logits = torch.randn(rows, vocab) * 4
    hist = [list(torch.randint(0, vocab, (64,)).tolist()) for _ in range(rows)]
    greedy = [Row(SamplingParams(temperature=0), seed=i) for i in range(rows)]
    sampled = [Row(SamplingParams(**SAMPLED), seed=i, output_ids=hist[i], prompt_ids=hist[i]) for i in range(rows)]
    top_p = [Row(SamplingParams(**TOP_P_ONLY), seed=i, output_ids=hist[i]) for i in range(rows)]
    gens = [torch.Generator().manual_seed(i) for i in range(rows)]
    peer_params = [SamplingParams(temperature=0.2, top_p=0.9) for _ in range(rows)]
    t_greedy = timed(lambda: sample_batch(logits, greedy), reps)
    res = [("greedy (argmax)", t_greedy),
           ("batched: T+top-k+top-p+min-p+3 penalties", timed(lambda: sample_batch(logits, sampled), reps)),
           ("batched: T 0.2, top-p 0.9, rep 1.1 (SmolLM2)", timed(lambda: sample_batch(logits, top_p), reps)),
           ("per-row full sort, T+top-p (before; peer)", timed(lambda: per_row_sort(logits, peer_params, gens), reps))]
    if engine is not None:
        from pdruntime.server.openai.structured import _json_grammar

        g = _json_grammar(SCHEMA)

        def constrained():
            rs = []
            for i in range(rows):
                m = engine.grammars.matcher(g)
                rs.append(Row(SamplingParams(temperature=0.8), seed=i, token_mask=engine.grammars.mask(m)))
            return sample_batch(logits, rs)

        res.append(("json_schema rows (matcher + bitmask each)", timed(constrained, reps)))
    print(f"\nsampler alone: {rows} rows x {vocab} vocab, median of {reps}")
    print(f"{'sampler':<46} {'ms/step':>9} {'x greedy':>9}")
    for name, t in res:
        print(f"{name:<46} {t * 1e3:>9.2f} {t / t_greedy:>9.2f}")


def engine_table(engine: Engine, rows: int, steps: int) -> None:
    """Paired: each decode step of 64 running sequences is timed whole, and on the very logits it sampled, the
    sampler is timed in every configuration; a configuration's step = step - its own sampler + that sampler."""
    from pdruntime.engine import engine as engine_mod
    from pdruntime.server.openai.structured import _json_grammar

    tok = engine.tokenizer
    prompt = tok.encode("Write a short story about a robot who learns to paint.")
    g = _json_grammar(SCHEMA)
    hist = [list(range(100, 164))] * rows
    configs = {
        "greedy": [Row(SamplingParams(temperature=0), seed=i) for i in range(rows)],
        "sampled (T, top-k, top-p, min-p, penalties)": [
            Row(SamplingParams(**SAMPLED), seed=i, output_ids=hist[i], prompt_ids=prompt) for i in range(rows)],
        "SmolLM2 defaults (T .2, top-p .9, rep 1.1)": [
            Row(SamplingParams(**TOP_P_ONLY), seed=i, output_ids=hist[i], prompt_ids=prompt) for i in range(rows)],
    }
    timings: dict[str, list[float]] = {k: [] for k in configs}
    timings["json_schema constrained, T 0.8"] = []
    steps_t: list[float] = []
    own: list[float] = []
    real = engine_mod.sample_batch

    def probe(logits, seqs):
        t0 = time.perf_counter()
        out = real(logits, seqs)
        own.append(time.perf_counter() - t0)
        if len(seqs) == rows:  # a decode step of the full batch: time every configuration on these logits
            for name, rs in configs.items():
                t0 = time.perf_counter()
                real(logits, rs)
                timings[name].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ms = [engine.grammars.matcher(g) for _ in range(rows)]
            real(logits, [Row(SamplingParams(temperature=0.8), seed=i, token_mask=engine.grammars.mask(m))
                          for i, m in enumerate(ms)])
            timings["json_schema constrained, T 0.8"].append(time.perf_counter() - t0)
        return out

    engine_mod.sample_batch = probe
    try:
        for i in range(rows):
            engine.add_request(f"b-{i}", prompt, SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True))
        while any(s.status.value != "running" for s in engine._seqs.values()):
            engine.step()
        for _ in range(steps):
            own.clear()
            t0 = time.perf_counter()
            engine.step()
            steps_t.append(time.perf_counter() - t0 - sum(timings[k][-1] for k in timings) - (own[-1] if own else 0))
        while engine.has_work():
            engine.step()
    finally:
        engine_mod.sample_batch = real
    fwd = statistics.median(steps_t)  # the step without any sampler
    base = fwd + statistics.median(timings["greedy"])
    print(f"\nengine decode steps: {rows} running sequences, {steps} steps, median; forward + bookkeeping "
          f"{fwd * 1e3:.1f} ms/step")
    print(f"{'decode step with sampler':<46} {'sampler ms':>10} {'step ms':>9} {'x greedy':>9}")
    for name, ts in timings.items():
        t = statistics.median(ts)
        print(f"{name:<46} {t * 1e3:>10.2f} {(fwd + t) * 1e3:>9.1f} {(fwd + t) / base:>9.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    from pdruntime.model import default_model_path, load_model

    cfg = EngineConfig.resolve(device=a.device, num_blocks=2048, max_num_seqs=a.rows, max_prefill_tokens=4096)
    loaded = load_model(a.model or default_model_path(), dtype=cfg.torch_dtype, device=cfg.device)
    engine = Engine(loaded, cfg)
    sampler_table(loaded.model.config.vocab_size, a.rows, 10, engine)
    engine_table(engine, a.rows, a.steps)


if __name__ == "__main__":
    main()

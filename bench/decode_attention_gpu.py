"""Decode-attention bandwidth on a GPU: pdstack's Triton kernel vs torch SDPA vs FlashInfer.

Decode attention reads every K/V byte of the batch once per step, so its speed of
light is the device's memory bandwidth. For each (batch, context) this prints the
achieved bandwidth, K/V bytes read / kernel time, next to a device-to-device copy
bandwidth measured on the same device (2 x bytes / time: a copy reads and writes).
Target from issue 4: >= 85% of copy bandwidth from 8k context up.

    python bench/decode_attention_gpu.py              # full grid, < 5 minutes on one GPU
    python bench/decode_attention_gpu.py --smoke      # tiny shapes, torch backend, CPU: plumbing only
    python bench/decode_attention_gpu.py --cpu-engine # the torch CPU serving path at engine shapes

Implementations (each skipped with the reason when it cannot run):
  pdstack   pdruntime.kernels.decode_attention (Triton, paged, heuristic splits)
  sdpa      torch scaled_dot_product_attention on a dense [B, Hkv, L, D] copy of the cache
  flashinfer BatchDecodeWithPagedKVCacheWrapper on the same paged cache (if importable)
Shapes: Llama-3-8B-like attention (Hq 32, Hkv 8, D 128), fp16, 16-token pages, all
sequences of one case at the same length.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch

from pdruntime.env import RuntimeEnv
from pdruntime.kernels.decode_attention import KernelConfig, decode_attention

CONTEXTS = (1024, 2048, 8192, 32768, 131072)
BATCHES = (1, 8, 64)


@dataclass
class Shape:
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page: int = 16
    dtype: torch.dtype = torch.float16


def make_inputs(batch: int, context: int, shape: Shape, device: str, seed: int = 0):
    """Paged cache holding exactly the batch's pages, in shuffled order (like a used pool).

    Generated on the device: a 64 x 128k fp16 cache is 17 GiB per K and V.
    """
    torch.manual_seed(seed)
    pages_per_seq = -(-context // shape.page)
    num_pages = batch * pages_per_seq
    cache_shape = (num_pages, shape.page, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, device=device, dtype=shape.dtype)
    v_cache = torch.randn(cache_shape, device=device, dtype=shape.dtype)
    block_table = torch.randperm(num_pages, device=device).to(torch.int32).view(batch, pages_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn((batch, shape.num_q_heads, shape.head_dim), device=device, dtype=shape.dtype)
    return q, k_cache, v_cache, block_table, seq_lens


def kv_bytes(batch: int, context: int, shape: Shape) -> int:
    return 2 * batch * context * shape.num_kv_heads * shape.head_dim * torch.finfo(shape.dtype).bits // 8


def time_fn(fn, device: str, min_time_s: float = 0.05, max_iters: int = 200) -> float:
    """Median seconds per call; CUDA events on GPU, perf_counter on CPU."""
    fn()  # warm-up (and Triton compile)
    if device == "cuda":
        torch.cuda.synchronize()
    samples: list[float] = []
    start_all = time.perf_counter()
    while len(samples) < max_iters and (time.perf_counter() - start_all < min_time_s or len(samples) < 5):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    samples.sort()
    return samples[len(samples) // 2]


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, bytes/s, counting read + write."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    seconds = time_fn(lambda: dst.copy_(src), device, min_time_s=0.2)
    return 2 * nbytes / seconds


def run_pdstack(q, k_cache, v_cache, block_table, seq_lens, config: KernelConfig):
    return lambda: decode_attention(q, k_cache, v_cache, block_table, seq_lens, config=config)


def run_sdpa(q, k_cache, v_cache, block_table, seq_lens, context: int):
    """SDPA on a dense [B, Hkv, L, D] copy, built one sequence at a time (peak: one extra copy)."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]

    def dense(cache):
        out = torch.empty((batch, num_kv_heads, context, head_dim), dtype=cache.dtype, device=cache.device)
        for b in range(batch):
            out[b] = cache[block_table[b].long()].reshape(-1, num_kv_heads, head_dim)[:context].transpose(0, 1)
        return out

    k, v = dense(k_cache), dense(v_cache)
    q4 = q[:, :, None, :]
    return lambda: torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True)[:, :, 0]


def run_flashinfer(q, k_cache, v_cache, block_table, seq_lens, page: int):
    import flashinfer  # noqa: PLC0415  (optional peer)

    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    pages_per_seq = block_table.shape[1]
    workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    indptr = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * pages_per_seq
    indices = block_table.reshape(-1).contiguous()
    last_page_len = ((seq_lens - 1) % page + 1).to(torch.int32)
    plan = getattr(wrapper, "plan", None) or wrapper.begin_forward
    args = (indptr, indices, last_page_len, num_q_heads, num_kv_heads, head_dim, page)
    try:
        plan(*args, q_data_type=q.dtype, kv_data_type=k_cache.dtype)
    except TypeError:  # older FlashInfer: one data_type
        plan(*args, data_type=q.dtype)
    run = getattr(wrapper, "run", None) or wrapper.forward
    return lambda: run(q, (k_cache, v_cache))


def check_close(fn, ref: torch.Tensor) -> float:
    out = fn()
    return float((out.float() - ref.float()).abs().max())


def bench(contexts, batches, shape: Shape, device: str, config: KernelConfig, mem_fraction: float) -> list[dict]:
    rows = []
    free = torch.cuda.mem_get_info()[0] if device == "cuda" else 8 << 30
    try:
        import flashinfer  # noqa: F401,PLC0415
        have_flashinfer = device == "cuda"
        flashinfer_note = "" if have_flashinfer else "cpu"
    except ImportError:
        have_flashinfer, flashinfer_note = False, "not installed"
    for context in contexts:
        for batch in batches:
            nbytes = kv_bytes(batch, context, shape)
            row = {"batch": batch, "context": context, "kv_mib": nbytes / 2**20}
            # paged cache + the dense copy SDPA needs must fit in the allowed share of free memory
            if 2 * nbytes > mem_fraction * free:
                row["note"] = "skipped: K/V does not fit"
                rows.append(row)
                continue
            inputs = make_inputs(batch, context, shape, device)
            pd_fn = run_pdstack(*inputs, config)
            ref = pd_fn()
            row["pdstack"] = nbytes / time_fn(pd_fn, device)
            try:
                sdpa_fn = run_sdpa(*inputs, context)
                row["sdpa_err"] = check_close(sdpa_fn, ref)
                row["sdpa"] = nbytes / time_fn(sdpa_fn, device)
                del sdpa_fn
            except Exception as exc:  # noqa: BLE001  (a peer failing is a table entry, not a crash)
                row["sdpa_note"] = f"{type(exc).__name__}: {exc}"[:60]
            if have_flashinfer:
                try:
                    fi_fn = run_flashinfer(*inputs, shape.page)
                    row["flashinfer_err"] = check_close(fi_fn, ref)
                    row["flashinfer"] = nbytes / time_fn(fi_fn, device)
                except Exception as exc:  # noqa: BLE001
                    row["flashinfer_note"] = f"{type(exc).__name__}: {exc}"[:60]
            else:
                row["flashinfer_note"] = flashinfer_note
            rows.append(row)
            del inputs, pd_fn, ref
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict], copy_bw: float | None, unit: str = "GB/s") -> None:
    def cell(row, key):
        if key in row:
            bw = row[key] / 1e9
            pct = f" {100 * row[key] / copy_bw:5.1f}%" if copy_bw else ""
            return f"{bw:8.1f}{pct}"
        return row.get(f"{key}_note", "-")[:16]

    head = f"{'batch':>5} {'context':>8} {'K/V MiB':>9} | {'pdstack ' + unit:>16} | {'sdpa ' + unit:>16} | {'flashinfer ' + unit:>18}"
    print(head)
    print("-" * len(head))
    for row in rows:
        if "note" in row:
            print(f"{row['batch']:>5} {row['context']:>8} {row['kv_mib']:>9.1f} | {row['note']}")
            continue
        print(f"{row['batch']:>5} {row['context']:>8} {row['kv_mib']:>9.1f} | {cell(row, 'pdstack'):>16} | "
              f"{cell(row, 'sdpa'):>16} | {cell(row, 'flashinfer'):>18}")
    errs = [(r["batch"], r["context"], r.get("sdpa_err"), r.get("flashinfer_err")) for r in rows if "note" not in r]
    worst_sdpa = max((e[2] for e in errs if e[2] is not None), default=None)
    worst_fi = max((e[3] for e in errs if e[3] is not None), default=None)
    print(f"max |pdstack - sdpa| = {worst_sdpa}, max |pdstack - flashinfer| = {worst_fi}")


def cpu_engine(threads: int | None) -> None:
    """The torch CPU serving path at the default model's shapes (SmolLM2-135M: Hq 9, Hkv 3, D 64)."""
    if threads:
        torch.set_num_threads(threads)
    shape = Shape(num_q_heads=9, num_kv_heads=3, head_dim=64, page=16, dtype=torch.float32)
    config = KernelConfig.from_env(RuntimeEnv(attention_backend="torch"), "cpu")
    print(f"torch CPU path, {torch.get_num_threads()} threads, fp32, Hq 9 / Hkv 3 / D 64, page 16; "
          "ms per call (median), per layer")
    print(f"{'batch':>5} {'context':>8} {'ms':>9} {'K/V GB/s':>9}")
    for batch in (1, 4, 16):
        for context in (128, 512, 2048):
            inputs = make_inputs(batch, context, shape, "cpu")
            seconds = time_fn(run_pdstack(*inputs, config), "cpu", min_time_s=0.3)
            print(f"{batch:>5} {context:>8} {seconds * 1e3:>9.3f} {kv_bytes(batch, context, shape) / seconds / 1e9:>9.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU with the torch backend (plumbing)")
    parser.add_argument("--cpu-engine", action="store_true", help="time the torch CPU path at engine shapes")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads for --cpu-engine")
    parser.add_argument("--contexts", type=int, nargs="*", default=list(CONTEXTS))
    parser.add_argument("--batches", type=int, nargs="*", default=list(BATCHES))
    parser.add_argument("--mem-fraction", type=float, default=0.8, help="share of free GPU memory a case may use")
    args = parser.parse_args(argv)

    if args.cpu_engine:
        cpu_engine(args.threads)
        return 0
    if args.smoke:
        shape = Shape(num_q_heads=6, num_kv_heads=2, head_dim=64, page=16, dtype=torch.float32)
        config = KernelConfig.from_env(RuntimeEnv(attention_backend="torch"), "cpu")
        print(f"smoke: CPU, torch backend, config {config.as_dict()}")
        rows = bench([64, 300], [1, 3], shape, "cpu", config, args.mem_fraction)
        print_table(rows, copy_bandwidth("cpu", 64 << 20))
        bad = [r for r in rows if r.get("sdpa_err", 0.0) > 1e-4 or "pdstack" not in r]
        if bad:
            print(f"smoke FAILED: {bad}")
            return 1
        print("smoke OK: plumbing runs, pdstack (torch backend) agrees with dense SDPA")
        return 0
    if not torch.cuda.is_available():
        print("decode_attention_gpu: no CUDA device visible (torch.cuda.is_available() is False); "
              "nothing to measure. Run on a GPU host, or use --smoke to check the script on CPU.")
        return 0

    config = KernelConfig.from_env(RuntimeEnv.from_environ(), "cuda")
    if config.backend != "triton":
        print(f"decode_attention_gpu: backend resolved to {config.backend!r}, not triton "
              "(PDRT_ATTENTION_BACKEND?); the table would not measure the kernel. Aborting.")
        return 2
    props = torch.cuda.get_device_properties(0)
    copy_bw = copy_bandwidth("cuda")
    print(f"device: {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB; "
          f"torch {torch.__version__}; date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"kernel config: {config.as_dict()}")
    print(f"device-to-device copy bandwidth: {copy_bw / 1e9:.1f} GB/s (read + write)")
    shape = Shape()
    print(f"shape: Hq {shape.num_q_heads}, Hkv {shape.num_kv_heads}, D {shape.head_dim}, page {shape.page}, "
          f"{shape.dtype}; GB/s = K/V bytes read / median time; % of copy bandwidth")
    t0 = time.perf_counter()
    rows = bench(args.contexts, args.batches, shape, "cuda", config, args.mem_fraction)
    print_table(rows, copy_bw)
    long_rows = [r for r in rows if "pdstack" in r and r["context"] >= 8192]
    if long_rows:
        worst = min(r["pdstack"] / copy_bw for r in long_rows)
        print(f"pdstack worst share of copy bandwidth at context >= 8k: {100 * worst:.1f}% (target 85%)")
    print(f"bench wall time {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

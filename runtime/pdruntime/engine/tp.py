"""Tensor parallelism across processes: rank 0 drives, ranks 1..N-1 follow its schedule.

``pdrt serve --tensor-parallel-size N`` runs rank 0 in the serving process: it owns the scheduler, the
HTTP server and sampling, and its model is wrapped in a :class:`TPDriver`. :func:`start` launches one
follower process per other rank (``python -m pdruntime.engine.tp``); each loads its own shard onto its
own device (``cuda:B+rank``, or the CPU) and owns its share of the KV cache (its KV heads, same pages).

Every model call on rank 0 is first broadcast as a typed :class:`Command` (the step's batch plan: token
ids, positions, page tables; small host tensors), then all ranks run the same forward, meeting in the
all-reduces after o and down. Commands and collectives only ever run on rank 0's engine thread, so
the order is the same on every rank. KV transfer: :meth:`TPDriver.gather_pages` collects every rank's
pages of a request on rank 0 (``dist.gather``), :meth:`TPDriver.scatter_pages` hands received pages to
their ranks (``dist.scatter``). NCCL on CUDA, gloo on the CPU.

Liveness: a follower exits when rank 0's process is gone; rank 0 exits non-zero (one log line naming
the rank) when a follower dies, so the pod restarts and the operator co-restarts the pair.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pdruntime.util.ports import free_port

log = logging.getLogger("pdruntime.tp")

# Collective timeout: an idle server waits in a broadcast for as long as no request comes, so this is
# effectively "never"; dead peers are found by the liveness watchers below, not by timeouts.
_PG_TIMEOUT = datetime.timedelta(days=3650)
LIVENESS_TICK_S = 1.0


@dataclass
class Command:
    """One step of rank 0's schedule that every follower runs too. Tensors are host tensors."""

    kind: str  # decode | prefill | agree_blocks | setup_kv | gather_pages | scatter_pages | capture_graphs | replay | stop
    args: dict[str, Any] = field(default_factory=dict)


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _broadcast(cmd: Command | None) -> Command:
    import torch.distributed as dist

    box = [cmd]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class _PageKV:
    """KV pages of one rank for one request, renumbered 0..n-1: k[layer], v[layer]: [n, page, Hkv_rank, D]."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        self.k, self.v = k, v


def _local_pages(kv, block_ids: torch.Tensor) -> torch.Tensor:
    """This rank's pages: [L, 2, n, page, Hkv_rank, D] on the cache's device."""
    idx = block_ids.to(kv.k[0].device)
    return torch.stack([torch.stack((kv.k[n].index_select(0, idx), kv.v[n].index_select(0, idx)))
                        for n in range(len(kv.k))])


def _write_pages(kv, block_ids: torch.Tensor, pages: torch.Tensor) -> None:
    """pages: [L, 2, n, page, Hkv_rank, D] -> this rank's cache at block_ids."""
    idx = block_ids.to(kv.k[0].device)
    pages = pages.to(kv.k[0].device)
    for n in range(len(kv.k)):
        kv.k[n].index_copy_(0, idx, pages[n, 0])
        kv.v[n].index_copy_(0, idx, pages[n, 1])


def _gather(local: torch.Tensor, size: int, rank: int) -> list[torch.Tensor] | None:
    import torch.distributed as dist

    bufs = [torch.empty_like(local) for _ in range(size)] if rank == 0 else None
    dist.gather(local.contiguous(), bufs, dst=0)
    return bufs


class TPDriver:
    """Rank 0's model: the same calls as ``LlamaModel`` (decode, prefill_batch, ...), each broadcast to the
    followers first. Everything else (config, dtype, device, attention_backend ...) is the local shard's."""

    def __init__(self, model, size: int, procs: list[subprocess.Popen]) -> None:
        self._model = model
        self.tp_size = size
        self._procs = procs
        self._kv = None
        self._stopped = False
        self._watch = threading.Thread(target=self._watch_followers, name="tp-liveness", daemon=True)
        self._watch.start()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    @property
    def follower_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _lockstep(self, what: str, fn, *args, **kw):
        """Run rank 0's half of a collective step. Once the command is out, the followers are inside the same
        collectives: a failure here leaves them waiting on a partner that never comes, so rank 0 exits
        (non-zero, one log line) instead of serving on with the group out of step."""
        try:
            return fn(*args, **kw)
        except BaseException as exc:
            log.critical("tensor-parallel %s failed on rank 0 after the followers started it (%s: %s); the ranks are "
                         "out of step, exiting", what, type(exc).__name__, exc)
            logging.shutdown()
            os._exit(3)

    # -- the model calls -------------------------------------------------------------------------
    def decode(self, token_ids, positions, k_cache, v_cache, block_table, seq_lens, *, attn_plan=None):
        _broadcast(Command("decode", {"token_ids": token_ids.cpu(), "positions": positions.cpu(),
                                      "block_table": block_table.cpu(), "seq_lens": seq_lens.cpu()}))
        return self._lockstep("decode", self._model.decode, token_ids, positions, k_cache, v_cache, block_table,
                              seq_lens)

    def prefill_batch(self, chunks, k_cache, v_cache, *, all_logits: bool = False):
        _broadcast(Command("prefill", {"chunks": [tuple(c) for c in chunks]}))
        return self._lockstep("prefill", self._model.prefill_batch, chunks, k_cache, v_cache, all_logits=all_logits)

    def prefill(self, token_ids, start_pos, k_cache, v_cache, block_ids, *, all_logits: bool = False):
        from ..model.llama import PrefillChunk

        return self.prefill_batch([PrefillChunk(token_ids, start_pos, block_ids)], k_cache, v_cache,
                                  all_logits=all_logits)[0]

    # -- CUDA graphs -------------------------------------------------------------------------------
    def capture_graphs(self, buckets: tuple[int, ...], max_model_len: int, scratch_page: int) -> "TPGraphs":
        """Every rank captures decode graphs of its own shard, bucket by bucket in the same order, agreeing
        after each step (``DecodeGraphs.capture(agree=...)``); raises (on every rank) if any rank failed."""
        from .cuda_graphs import CaptureRefused, DecodeGraphs

        _broadcast(Command("capture_graphs", {"buckets": tuple(buckets), "max_model_len": max_model_len,
                                              "scratch_page": scratch_page}))
        graphs = DecodeGraphs(self._model, self._kv, buckets=buckets, max_model_len=max_model_len,
                              scratch_page=scratch_page)
        try:
            graphs.capture(agree=_agree_fn(self._coll_device()))
        except CaptureRefused:
            raise  # every rank stopped at the same point: the engine decodes eagerly
        except BaseException:  # e.g. a warm-up step: the followers are inside its collectives
            self._lockstep("CUDA graph warm-up", _reraise)
        return TPGraphs(graphs)

    # -- KV cache ----------------------------------------------------------------------------------
    def agree_num_blocks(self, num_blocks: int) -> int:
        """The smallest page count any rank can hold (each follower sizes its own from its memory)."""
        import torch.distributed as dist

        _broadcast(Command("agree_blocks", {"num_blocks": num_blocks}))
        t = torch.tensor([num_blocks], dtype=torch.int64, device=self._coll_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def setup_kv(self, kv) -> None:
        """Followers allocate their KV share: the same pages and page size, their own KV heads."""
        self._kv = kv
        _broadcast(Command("setup_kv", {"num_blocks": kv.num_blocks, "block_size": kv.block_size}))

    def gather_pages(self, block_ids: list[int]) -> list[_PageKV]:
        """Every rank's pages ``block_ids`` of one request, on rank 0's host, one _PageKV per rank."""
        ids = torch.tensor(block_ids, dtype=torch.int64)
        _broadcast(Command("gather_pages", {"block_ids": ids}))
        bufs = self._lockstep("page gather", lambda: _gather(_local_pages(self._kv, ids), self.tp_size, 0))
        out = []
        for b in bufs:
            b = b.cpu()
            out.append(_PageKV([b[n, 0] for n in range(b.shape[0])], [b[n, 1] for n in range(b.shape[0])]))
        return out

    def empty_pages(self, num_pages: int) -> list[_PageKV]:
        """Host staging for one request's incoming pages, one _PageKV per rank (filled by the transfer)."""
        kv = self._kv
        shape = (num_pages, kv.block_size, kv.num_kv_heads, kv.head_dim)
        return [_PageKV([torch.zeros(shape, dtype=kv.dtype) for _ in kv.k], [torch.zeros(shape, dtype=kv.dtype) for _ in kv.k])
                for _ in range(self.tp_size)]

    def scatter_pages(self, block_ids: list[int], staged: list[_PageKV]) -> None:
        """Write each rank's staged pages into that rank's cache at ``block_ids``."""
        import torch.distributed as dist

        ids = torch.tensor(block_ids, dtype=torch.int64)
        dev = self._coll_device()
        parts = [torch.stack([torch.stack((s.k[n], s.v[n])) for n in range(len(s.k))]).to(dev) for s in staged]
        _broadcast(Command("scatter_pages", {"block_ids": ids}))

        def scatter() -> None:
            mine = torch.empty_like(parts[0])
            dist.scatter(mine, parts, src=0)
            _write_pages(self._kv, ids, mine)

        self._lockstep("page scatter", scatter)

    # -- lifecycle ---------------------------------------------------------------------------------
    def _coll_device(self) -> torch.device:
        dev = torch.device(self._model.device)
        return dev if dev.type == "cuda" else torch.device("cpu")

    def _watch_followers(self) -> None:
        while not self._stopped:
            for rank, p in enumerate(self._procs, start=1):
                code = p.poll()
                if code is not None and not self._stopped:
                    log.error("tensor-parallel rank %d (pid %d) exited with code %s; rank 0 cannot continue, exiting",
                              rank, p.pid, code)
                    logging.shutdown()
                    os._exit(3)
            time.sleep(LIVENESS_TICK_S)

    def shutdown(self) -> None:
        """Stop the followers and leave the process group (idempotent)."""
        if self._stopped:
            return
        import torch.distributed as dist

        self._stopped = True
        try:
            _broadcast(Command("stop"))
        except Exception:  # noqa: BLE001 - a follower already gone
            pass
        for p in self._procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


def _reraise() -> None:
    raise  # noqa: PLE0704 - re-raise the exception being handled, inside _lockstep's try


def _agree_fn(coll_device: torch.device):
    """ok here -> ok on every rank (all-reduce MIN of a flag)."""
    import torch.distributed as dist

    def agree(ok: bool) -> bool:
        t = torch.tensor([1 if ok else 0], dtype=torch.int32, device=coll_device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    return agree


class TPGraphs:
    """Rank 0's decode graphs: a replay is broadcast first, so every rank replays the same bucket with the
    same inputs (the graphs' all-reduces meet); steps no bucket fits return None (the engine runs eagerly)."""

    def __init__(self, graphs) -> None:
        self.local = graphs
        self.buckets = graphs.buckets

    @property
    def replays(self) -> int:
        return self.local.replays

    def run(self, tokens, positions, table, seq_lens):
        if not self.local.fits(tokens.shape[0], table.shape[1]):
            return None
        _broadcast(Command("replay", {"tokens": tokens, "positions": positions, "table": table, "seq_lens": seq_lens}))
        return self.local.run(tokens, positions, table, seq_lens)




def start(source: str | None, config, *, weights: str = "fp32", threads: int | None = None, env=None):
    """Launch ranks 1..N-1, join the group as rank 0, load rank 0's shard.

    -> LoadedModel whose ``model`` is a :class:`TPDriver` (call ``loaded.model.shutdown()`` to stop)."""
    import torch.distributed as dist

    from ..model import load_model
    from ..model.parallel import TPShard
    from .device import rank_device

    size = config.tensor_parallel_size
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed group is already initialised in this process; one TP engine per process")
    init = f"tcp://127.0.0.1:{free_port()}"
    cfg_json = json.dumps(dataclasses.asdict(config))
    procs = []
    for rank in range(1, size):
        argv = [sys.executable, "-m", "pdruntime.engine.tp", "--rank", str(rank), "--size", str(size),
                "--init-method", init, "--config", cfg_json, "--weights", weights, "--parent-pid", str(os.getpid())]
        if source is not None:
            argv += ["--model", str(source)]
        if threads:
            argv += ["--threads", str(threads)]
        procs.append(subprocess.Popen(argv))
    try:
        device = rank_device(config.device, 0)
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        dist.init_process_group(_backend(device), init_method=init, rank=0, world_size=size, timeout=_PG_TIMEOUT)
        loaded = load_model(source, dtype=config.torch_dtype, device=device, weights=weights,
                            tp=TPShard(0, size), env=env)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    driver = TPDriver(loaded.model, size, procs)
    log.info("tensor parallelism: %d ranks (%s), rank 0 on %s, followers pids %s", size, _backend(device), device,
             [p.pid for p in procs])
    return dataclasses.replace(loaded, model=driver)


def follow(model, config, rank: int, size: int) -> None:
    """A follower's loop: run rank 0's commands until ``stop``."""
    import torch.distributed as dist

    from .device import kv_cache_blocks
    from .kv_cache import KVCache

    cfg = model.config
    kv = graphs = None
    coll_dev = model.device if model.device.type == "cuda" else torch.device("cpu")
    dev = model.device
    with torch.inference_mode():
        while True:
            cmd = _broadcast(None)
            a = cmd.args
            if cmd.kind == "decode":
                model.decode(a["token_ids"].to(dev), a["positions"].to(dev), kv.k, kv.v, a["block_table"].to(dev),
                             a["seq_lens"].to(dev))
            elif cmd.kind == "prefill":
                from ..model.llama import PrefillChunk

                model.prefill_batch([PrefillChunk(*c) for c in a["chunks"]], kv.k, kv.v)
            elif cmd.kind == "agree_blocks":
                per_block = KVCache.bytes_per_block(cfg.num_layers, config.block_size, cfg.num_kv_heads, cfg.head_dim,
                                                    model.dtype)
                free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else None
                mine, _ = kv_cache_blocks(per_block, useful_blocks=a["num_blocks"], num_blocks=config.num_blocks,
                                          kv_cache_mib=config.kv_cache_mib,
                                          memory_fraction=config.kv_cache_memory_fraction, free_bytes=free)
                t = torch.tensor([min(mine, a["num_blocks"])], dtype=torch.int64, device=coll_dev)
                dist.all_reduce(t, op=dist.ReduceOp.MIN)
            elif cmd.kind == "setup_kv":
                kv = KVCache(cfg.num_layers, a["num_blocks"], a["block_size"], cfg.num_kv_heads, cfg.head_dim,
                             dtype=model.dtype, device=dev)
            elif cmd.kind == "gather_pages":
                _gather(_local_pages(kv, a["block_ids"]), size, rank)
            elif cmd.kind == "scatter_pages":
                n = a["block_ids"].numel()
                mine = torch.empty((cfg.num_layers, 2, n, kv.block_size, cfg.num_kv_heads, cfg.head_dim),
                                   dtype=model.dtype, device=coll_dev)
                dist.scatter(mine, None, src=0)
                _write_pages(kv, a["block_ids"], mine)
            elif cmd.kind == "capture_graphs":
                from .cuda_graphs import CaptureRefused, DecodeGraphs

                graphs = DecodeGraphs(model, kv, buckets=a["buckets"], max_model_len=a["max_model_len"],
                                      scratch_page=a["scratch_page"])
                try:
                    graphs.capture(agree=_agree_fn(coll_dev))
                except CaptureRefused as exc:  # every rank raised the same verdict: decode eagerly, like rank 0
                    log.warning("CUDA graphs: %s; decoding eagerly", exc)
                    graphs = None
            elif cmd.kind == "replay":
                graphs.run(a["tokens"], a["positions"], a["table"], a["seq_lens"])
            elif cmd.kind == "stop":
                return
            else:
                raise RuntimeError(f"unknown tensor-parallel command {cmd.kind!r}")


def _watch_parent(parent_pid: int) -> None:
    """Exit when rank 0's process is gone (its collectives would never come)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(0)
        time.sleep(LIVENESS_TICK_S)


def main(argv: list[str] | None = None) -> int:
    """Follower entry point: ``python -m pdruntime.engine.tp --rank R --size N --init-method URL --config JSON``."""
    import torch.distributed as dist

    from ..model import load_model
    from ..model.parallel import TPShard
    from .config import EngineConfig
    from .device import rank_device

    ap = argparse.ArgumentParser(prog="pdruntime.engine.tp")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--init-method", required=True)
    ap.add_argument("--config", required=True, help="EngineConfig as JSON (rank 0's)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--weights", default="fp32")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--parent-pid", type=int, required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level="INFO", format=f"%(asctime)s %(levelname)s tp-rank{args.rank}: %(message)s")
    threading.Thread(target=_watch_parent, args=(args.parent_pid,), daemon=True).start()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = EngineConfig(**json.loads(args.config))
    device = rank_device(config.device, args.rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(_backend(device), init_method=args.init_method, rank=args.rank, world_size=args.size,
                            timeout=_PG_TIMEOUT)
    loaded = load_model(args.model, dtype=config.torch_dtype, device=device, weights=args.weights,
                        tp=TPShard(args.rank, args.size))
    log.info("rank %d/%d loaded its shard on %s", args.rank, args.size, device)
    follow(loaded.model, config, args.rank, args.size)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

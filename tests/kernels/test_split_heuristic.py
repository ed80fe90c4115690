"""Properties of the split-K heuristic, the knobs' validation and the /config report.

hypothesis is not installed; the property tests are a seeded random sweep (fixed seed,
so a failure reproduces; the failing draw is in the assertion message).
"""

from __future__ import annotations

import random

import pytest
import torch

from pdruntime.env import ConfigError, RuntimeEnv
from pdruntime.kernels import decode_attention as da
from pdruntime.kernels.split_heuristic import (
    BLOCK_N,
    cdiv,
    effective_target_ctas,
    normalise_splits,
    num_kv_splits,
    split_bounds,
)

SM_COUNTS = (1, 2, 8, 16, 78, 108, 132, 170)  # CPU threads and real GPUs (V100 .. B200)


def _draw(rng: random.Random) -> dict:
    batch = rng.choice((1, 1, 2, 3, 8, 16, 64, 300))
    # Lengths log-uniform from 1 token to 256k, plus exact tile boundaries.
    lens = [rng.choice((int(2 ** rng.uniform(0, 18)), rng.randint(1, 4) * BLOCK_N, 1)) for _ in range(batch)]
    return dict(seq_lens=lens, num_sms=rng.choice(SM_COUNTS),
                target_ctas=rng.choice((0, 512, rng.randint(1, 8192))), max_splits=rng.choice((1, 2, 8, 32, 64, 1024)),
                num_kv_heads=rng.choice((1, 2, 3, 8)), block_n=rng.choice((16, 64)))


DRAWS = [_draw(random.Random(seed)) for seed in range(2000)]


def test_splits_between_one_and_max_and_never_more_than_blocks():
    for args in DRAWS:
        splits = num_kv_splits(**args)
        assert len(splits) == len(args["seq_lens"]), args
        for n, s in zip(args["seq_lens"], splits):
            assert 1 <= s <= args["max_splits"], (args, n, s)
            assert s <= cdiv(n, args["block_n"]), (args, n, s)


def test_every_split_has_work_and_splits_tile_the_sequence():
    # The kernel's partition of each sequence (split_bounds) has no empty split and
    # covers every token exactly once: no CTA is launched without work.
    for args in DRAWS:
        for n, s in zip(args["seq_lens"], num_kv_splits(**args)):
            bounds = split_bounds(n, s, args["block_n"])
            assert all(start < end for start, end in bounds), (args, n, s, bounds)
            assert bounds[0][0] == 0 and bounds[-1][1] == n, (args, n, s, bounds)
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:])), (args, n, s, bounds)
            assert all(start % args["block_n"] == 0 for start, _ in bounds), (args, n, s, bounds)


def test_grid_never_exceeds_the_whole_wave_target():
    # Splitting adds CTAs only up to the target rounded up to whole waves; a batch that
    # alone exceeds it is not split at all.
    for args in DRAWS:
        splits = num_kv_splits(**args)
        target = effective_target_ctas(args["target_ctas"], args["num_sms"])
        ctas = args["num_kv_heads"] * sum(splits)
        if len(splits) * args["num_kv_heads"] > target:
            assert splits == [1] * len(splits), args
        else:
            assert ctas <= target, (args, splits)


def test_large_target_on_long_context_gives_every_cta_work():
    # One 128k-token sequence: the heuristic splits up to the target or the cap, and
    # every one of those CTAs has at least one tile of KV to read.
    rng = random.Random(1)
    for _ in range(500):
        n = rng.randint(32_768, 131_072)
        num_sms, heads = rng.choice(SM_COUNTS), rng.choice((1, 2, 8))
        target, cap = rng.choice((512, 1024, 4096, 65_536)), rng.choice((32, 64, 256, 1024))
        (s,) = num_kv_splits([n], num_sms, target, cap, num_kv_heads=heads)
        slots = effective_target_ctas(target, num_sms) // heads
        assert s == normalise_splits(cdiv(n, BLOCK_N), min(cap, slots)), (n, num_sms, heads, target, cap, s)
        assert all(start < end for start, end in split_bounds(n, s)), (n, s)
        assert heads * s > effective_target_ctas(target, num_sms) // 2 or s > cap // 2, (n, num_sms, target, cap, s)


def test_mixed_batch_splits_follow_the_work():
    long, short = 64 * 1000, 64 * 10
    splits = num_kv_splits([long, short, 1], 132, 0, 64, num_kv_heads=1)
    assert splits[0] > splits[1] >= splits[2] == 1
    # The busiest CTA reads about as much as an even split of all tiles over the grid.
    tiles = [cdiv(n, BLOCK_N) for n in (long, short, 1)]
    busiest = max(cdiv(t, s) for t, s in zip(tiles, splits))
    assert busiest <= 2 * cdiv(sum(tiles), sum(splits))


def test_no_split_when_the_batch_fills_the_target():
    assert num_kv_splits([100_000] * 300, 132, 0, 32, num_kv_heads=1) == [1] * 300
    assert num_kv_splits([100_000] * 40, 132, 0, 32, num_kv_heads=8) == [1] * 40  # 320 CTAs > 264


def test_target_rounds_up_to_whole_waves_and_zero_means_two_waves():
    assert effective_target_ctas(0, 132) == 264
    assert effective_target_ctas(512, 132) == 528  # 3.9 waves -> 4
    assert effective_target_ctas(264, 132) == 264
    assert effective_target_ctas(1, 132) == 132
    with pytest.raises(ValueError):
        effective_target_ctas(-1, 132)
    with pytest.raises(ValueError):
        effective_target_ctas(0, 0)


def test_invalid_arguments_are_rejected():
    with pytest.raises(ValueError, match="max_splits"):
        num_kv_splits([10], 8, 0, 0)
    with pytest.raises(ValueError, match="length"):
        num_kv_splits([10, 0], 8, 0, 4)
    assert num_kv_splits([], 8, 0, 4) == []
    assert num_kv_splits(torch.tensor([5, 700], dtype=torch.int32), 8, 0, 4) == num_kv_splits([5, 700], 8, 0, 4)


@pytest.mark.parametrize("name, value", [
    ("PDRT_DECODE_TARGET_CTAS", "-1"), ("PDRT_DECODE_TARGET_CTAS", "many"), ("PDRT_DECODE_TARGET_CTAS", "1e9"),
    ("PDRT_MAX_KV_SPLITS", "0"), ("PDRT_MAX_KV_SPLITS", "2.5"), ("PDRT_ATTENTION_BACKEND", "cuda"),
])
def test_bad_knob_values_fail_start_up_with_the_variable_named(name, value):
    with pytest.raises(ConfigError, match=name):
        da.KernelConfig.from_env(RuntimeEnv.from_environ({name: value}), "cpu")


def test_kernel_config_reports_effective_values():
    env = RuntimeEnv.from_environ({"PDRT_DECODE_TARGET_CTAS": "512", "PDRT_MAX_KV_SPLITS": "16",
                                   "PDRT_ATTENTION_BACKEND": "torch"})
    cfg = da.KernelConfig.from_env(env, "cpu")
    report = cfg.as_dict()
    assert report["backend"] == "torch" and report["device"] == "cpu"
    assert report["target_ctas"] == 512 and report["max_splits"] == 16
    assert report["num_sms"] >= 1 and report["block_n"] == BLOCK_N
    assert report["effective_target_ctas"] == effective_target_ctas(512, report["num_sms"])


def test_configure_sets_what_decode_attention_and_config_report_use(monkeypatch):
    monkeypatch.setattr(da, "_active", None)
    cfg = da.configure(RuntimeEnv(attention_backend="torch", max_kv_splits=7), "cpu")
    assert da.active_config() is cfg and da.kernel_config()["max_splits"] == 7


def test_auto_never_picks_the_interpreter_on_cpu():
    """auto on the CPU: pdstack's native kernel where it builds, else torch; Triton's interpreter never."""
    assert da.select_backend(RuntimeEnv(attention_backend="auto"), "cpu") == "cpu"
    assert da.select_backend(RuntimeEnv(attention_backend="torch"), "cpu") == "torch"
    assert da.select_backend(RuntimeEnv(attention_backend="cpu"), "cpu") == "cpu"


def test_auto_falls_back_to_torch_where_the_cpu_kernels_cannot_be_built(monkeypatch):
    monkeypatch.setattr(da, "cpu_kernels_unavailable", lambda: "no C compiler (cc, gcc or clang) on PATH")
    assert da.select_backend(RuntimeEnv(attention_backend="auto"), "cpu") == "torch"
    with pytest.raises(ConfigError, match="PDRT_ATTENTION_BACKEND=cpu but pdstack's CPU kernels cannot be used here: "
                                          "no C compiler.*accepted here: torch or auto"):
        da.select_backend(RuntimeEnv(attention_backend="cpu"), "cpu")
    with pytest.raises(ConfigError, match="PDRT_ATTENTION_BACKEND=cpu but the device is cuda"):
        da.select_backend(RuntimeEnv(attention_backend="cpu"), "cuda")


def test_forced_triton_without_a_way_to_run_it_fails_start_up(monkeypatch):
    monkeypatch.setattr(da, "triton_interpreter_active", lambda: False)
    with pytest.raises(ConfigError, match="PDRT_ATTENTION_BACKEND=triton.*accepted here: torch or auto"):
        da.select_backend(RuntimeEnv(attention_backend="triton"), "cpu")
    monkeypatch.setattr(da, "triton_importable", lambda: False)
    with pytest.raises(ConfigError, match="not installed"):
        da.select_backend(RuntimeEnv(attention_backend="triton"), "cpu")


def test_config_of_a_process_that_never_used_the_cpu_kernels_builds_none(monkeypatch):
    """/config on a CPU worker that runs without pdstack's kernels (the torch backend, fp32 weights) reports that,
    without compiling them in the scrape (about a second of the event loop); once used, it reports their build."""
    from pdruntime.kernels.cpu import native

    cfg = da.KernelConfig.from_env(RuntimeEnv(attention_backend="torch"), "cpu")
    with monkeypatch.context() as m:
        native._load.cache_clear()
        m.setattr(native, "library_path", lambda: pytest.fail("reading /config built the CPU kernels"))
        assert not native.tried()
        assert cfg.as_dict()["cpu_kernels"] == "not built: nothing in this process has used them"
    native._load.cache_clear()
    why = native.unavailable_reason()  # a use: built (or found unbuildable) once, as the engine would
    assert native.tried()
    assert cfg.as_dict()["cpu_kernels"] == (f"unavailable: {why}" if why else native.simd_level())

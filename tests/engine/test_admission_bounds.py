"""Sampling parameters that reach the engine directly (not through the HTTP request model) never make a step raise."""

from __future__ import annotations

import pytest
import torch

from pdruntime.engine import InvalidRequest, SamplingParams
from pdruntime.engine.sampler import Row, sample_batch


@pytest.mark.parametrize("t", [5e-324, 1e-45, 1e-40, 1e-6])
def test_a_positive_temperature_below_the_floor_samples_greedily(t):
    # logits / T overflows fp32 to inf below ~1e-38 (NaN probabilities): the engine takes the T -> 0 limit
    logits = torch.tensor([[0.1, 2.0, 0.3, 1.9]])
    p = SamplingParams(temperature=t)
    assert p.greedy
    assert sample_batch(logits, [Row(p, seed=7)]).tokens == [1]


@pytest.mark.parametrize("seed", [-1, 2 ** 64, True, 1.5])
def test_a_seed_the_generator_cannot_take_is_refused_at_admission(seed):
    with pytest.raises(InvalidRequest, match=r"seed=.*accepted: an integer in \[0, 2\*\*64\)"):
        SamplingParams(temperature=1.0, seed=seed)
    SamplingParams(temperature=1.0, seed=2 ** 64 - 1)  # the largest torch.Generator.manual_seed takes

"""The torch catalogue against its float64 finite-difference reference, seed after seed.

References must never flake. `make test` runs seeds 1 and 2 (seed 0 is the catalogue
`tests/test_testing_kit.py` runs); `make flake` runs 200 (ACTIVITY_FLAKE_SEEDS=200), the check
whose result the project reports.
"""

from __future__ import annotations

import os

import pytest

import activity as ad
from activity.testing import nn_scenarios, test_differentiation

def _seeds(spec: str) -> range:
    """``"N"`` (seeds 0..N-1) or ``"START:STOP"`` (for running the sweep in shards)."""
    start, _, stop = spec.rpartition(":")
    return range(int(start or 0), int(stop))


@pytest.mark.slow
@pytest.mark.parametrize("seed", _seeds(os.environ.get("ACTIVITY_FLAKE_SEEDS", "1:3")))
def test_torch_catalogue_passes_on_every_seed(seed):
    report = test_differentiation([ad.AutoTorch()], nn_scenarios("torch", seed=seed))
    assert report.counts() == {"pass": len(report.scenarios), "FAIL": 0, "unsupported": 0}

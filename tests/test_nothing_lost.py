"""Nothing is lost on the reference backend either: finite differences over the catalogues.

The AD backends are checked over every catalogue in tests/test_testing_kit.py;
`test_differentiation` snapshots every argument (arrays bitwise; modules'
parameters, buffers, .grad, requires_grad, training) and the global RNGs of
`random`, numpy and torch around each call, and fails on any change.
"""

from __future__ import annotations

import pytest

import activity as ad
from activity.testing import default_scenarios, nn_scenarios, test_differentiation


def covering(scenarios):
    """One scenario per operator and mix of annotation kinds: every way arguments reach the
    backend, at a fraction of the catalogue's cost (finite differences evaluate f many times)."""
    chosen: dict = {}
    for s in scenarios:
        chosen.setdefault((s.op, tuple(sorted({type(arg).__name__ for arg in s.args}))), s)
    return list(chosen.values())


@pytest.mark.parametrize("framework", ["jax", "torch"])  # numpy: tests/test_testing_kit.py
def test_finite_differences_leave_every_kind_of_default_scenario_intact(framework):
    scenarios = covering(default_scenarios(framework))
    assert {type(arg).__name__ for s in scenarios for arg in s.args} >= {"Active", "Constant"}
    report = test_differentiation([ad.AutoFiniteDifferences()], scenarios, prepared=False)
    assert report.counts()["pass"] == len(scenarios)


def test_finite_differences_leave_stateful_models_intact():
    names = ("batchnorm", "lstm", "embedding", "multihead_attention")
    # (the stacked LSTM is the same nn.LSTM state as the one-layer one, at half this test's time)
    scenarios = [s for s in nn_scenarios("torch", seed=1) if any(n in s.name for n in names) and s.name != "lstm_stacked"]
    assert len(scenarios) >= 6
    report = test_differentiation([ad.AutoFiniteDifferences()], scenarios)
    assert report.counts()["pass"] == len(scenarios)

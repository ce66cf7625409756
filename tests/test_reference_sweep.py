"""The finite-difference reference on kinked float32 models: no false alarms, planted errors caught.

Each seed builds five small float32 torch models with kinks (ReLU MLP and CNN,
MaxPool, Maxout, a ResNet block with BatchNorm in train mode). The check is the
testing kit's: `check_scenario` of a gradient scenario against the float64
finite-difference reference. A correct backend (AutoTorch) must pass every case;
the same backend with a planted 1% error in one leaf's gradient (a custom
`torch.autograd.Function`) must be caught. `make test` runs two seeds,
`make flake` runs 200 (ACTIVITY_SWEEP_SEEDS) and prints the rates the docs quote.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import activity as ad
from activity import Active, Constant
from activity.testing import Scenario, check_scenario


class Maxout(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 6)

    def forward(self, x):
        return self.linear(x).reshape(-1, 3, 2).max(-1).values


class ResidualBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn, self.conv2 = nn.Conv2d(2, 2, 3, padding=1), nn.BatchNorm2d(2), nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        return torch.relu(x + self.conv2(torch.relu(self.bn(self.conv1(x)))))


def kinked_models(seed: int) -> dict:
    """name -> (model, input), every value from ``seed`` (the global RNG is forked, not touched)."""
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return {
            "relu_mlp": (nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), torch.randn(6, 4, generator=g)),
            "relu_cnn": (
                nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(32, 1)),
                torch.randn(2, 1, 6, 6, generator=g),
            ),
            "maxpool": (
                nn.Sequential(nn.Conv2d(1, 2, 3), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8, 1)),
                torch.randn(2, 1, 6, 6, generator=g),
            ),
            "maxout": (nn.Sequential(Maxout(), nn.Linear(3, 1)), torch.randn(5, 4, generator=g)),
            "resnet_bn": (
                nn.Sequential(ResidualBlock(), nn.Flatten(), nn.Linear(32, 1)).train(),
                torch.randn(2, 2, 4, 4, generator=g),
            ),
        }


class OnePercentOff(torch.autograd.Function):
    """Identity forward; the gradient 1% too large: a planted bug in one leaf."""

    @staticmethod
    def forward(x):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.01


class PlantedTorch(ad.AutoTorch):
    """AutoTorch whose first differentiated leaf passes through `OnePercentOff`."""

    def bind_module(self, module, params):
        if params:
            params = [OnePercentOff.apply(params[0]), *params[1:]]
        return super().bind_module(module, params)


def loss(model, x):
    return model(x).pow(2).mean()


def outcome(backend, model, x) -> bool:
    """Whether the kit's check passes ``backend`` on the gradient of ``loss``."""
    scenario = Scenario("gradient", loss, (Active(model), Constant(x)), name="sweep")
    try:
        check_scenario(backend, scenario, prepared=False)
    except AssertionError:
        return False
    return True


def _seeds(spec: str) -> range:
    start, _, stop = spec.rpartition(":")
    return range(int(start or 0), int(stop))


SEEDS = _seeds(os.environ.get("ACTIVITY_SWEEP_SEEDS", "2"))


@pytest.mark.slow
def test_kinked_models_no_false_alarm_and_planted_errors_caught():
    false_alarms, missed, cases = [], [], 0
    for seed in SEEDS:
        for name, (model, x) in kinked_models(seed).items():
            cases += 1
            if not outcome(ad.AutoTorch(), model, x):
                false_alarms.append((name, seed))
            if outcome(PlantedTorch(), model, x):
                missed.append((name, seed))
    print(
        f"\nreference sweep over {cases} cases ({len(SEEDS)} seeds x 5 kinked models): "
        f"{len(false_alarms)} false alarms ({100 * len(false_alarms) / cases:.1f}%), "
        f"planted 1% errors caught in {cases - len(missed)} ({100 * (cases - len(missed)) / cases:.1f}%)"
    )
    assert not false_alarms, f"a correct backend was blamed on {false_alarms}"
    assert len(missed) <= 0.01 * cases, f"planted errors missed on {missed}"


def test_the_planted_error_is_one_percent_in_one_leaf():
    model, x = kinked_models(0)["relu_mlp"]
    right = ad.gradient(loss, Active(model), Constant(x))
    planted = ad.gradient(loss, Active(model), Constant(x), backend=PlantedTorch())
    first, *rest = right
    torch.testing.assert_close(planted[first], 1.01 * right[first])
    for name in rest:
        torch.testing.assert_close(planted[name], right[name])

"""One model, several backends: test_differentiation prints a scenario x backend table.

A small torch MLP loss, checked for gradient, hvp and hessian on AutoTorch, on
SecondOrder(AutoTorch(), AutoTorch()) and on AutoFiniteDifferences, all against the
default float64 finite-difference reference.
"""

import torch

import activity as ad
from activity import Active, Constant
from activity.testing import Scenario, test_differentiation

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
x = torch.randn(8, 3)
w = torch.randn(3)


def model_loss(model, x):
    return model(x).pow(2).mean()


def weights_loss(w, x):
    return torch.tanh(x @ w).pow(2).mean()


scenarios = [
    Scenario("gradient", model_loss, [Active(model), Constant(x)], name="mlp-gradient"),
    Scenario("value_and_gradient", model_loss, [Active(model), Constant(x)], name="mlp-value_and_gradient"),
    Scenario("gradient", weights_loss, [Active(w), Constant(x)], name="tanh-gradient"),
    Scenario("hvp", weights_loss, [Active(w), Constant(x)], tangent=torch.ones(3), name="tanh-hvp"),
    Scenario("hessian", weights_loss, [Active(w), Constant(x)], name="tanh-hessian"),
]
backends = [ad.AutoTorch(), ad.SecondOrder(ad.AutoTorch(), ad.AutoTorch()), ad.AutoFiniteDifferences()]
report = test_differentiation(backends, scenarios)
print(report)

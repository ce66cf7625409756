"""Migrating a closure-based gradient test suite to annotated scenarios.

Before: each test builds a closure over its data and compares torch.autograd with a
hand-written expected value. After: each case is one Scenario (data as Constant);
`test_differentiation` checks any backend against float64 finite differences, and
`closurify` turns the scenarios back into the old closure style to show both agree.
"""

import torch

import activity as ad
from activity import Active, Constant
from activity.testing import Scenario, assert_tree_allclose, closurify, test_differentiation

x = torch.linspace(-1.0, 1.0, 12).reshape(4, 3)
w = torch.tensor([0.3, -0.2, 0.5])


# --- before: one closure per test, expected values written by hand -------------------------
def old_test_quadratic():
    closure = lambda w: ((x @ w) ** 2).sum()  # noqa: E731  (captures x)
    w_ = w.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(closure(w_), w_)
    torch.testing.assert_close(g, 2 * x.T @ (x @ w))


old_test_quadratic()
print("old closure-based test: passed")


# --- after: the data is a Constant argument; the reference computes the expected result ----
def quadratic(w, x):
    return ((x @ w) ** 2).sum()


def softplus_loss(w, x):
    return torch.nn.functional.softplus(x @ w).mean()


scenarios = [
    Scenario("gradient", quadratic, [Active(w), Constant(x)], name="quadratic"),
    Scenario("gradient", softplus_loss, [Active(w), Constant(x)], prep_args=[Active(w), Constant(2 * x)], name="softplus"),
    Scenario("hvp", quadratic, [Active(w), Constant(x)], tangent=torch.ones(3), name="quadratic-hvp"),
]
report = test_differentiation([ad.AutoTorch()], scenarios)
print(report)

# closurify moves each Constant back into a closure: the old style, same expected results.
closures = closurify(scenarios)
print("closurified:", [s.name for s in closures], "args per scenario:", [len(s.args) for s in closures])
for annotated, closed in zip(scenarios, closures):
    assert_tree_allclose(closed.run(ad.AutoTorch()), annotated.run(ad.AutoTorch()), rtol=1e-6, atol=1e-6)
print("closure form and annotated form agree on every scenario")
print(test_differentiation([ad.AutoTorch()], closures).counts())

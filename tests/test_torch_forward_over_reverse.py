"""AutoTorch forward mode over an AutoTorch gradient or pullback called inside f.

One tangent runs on dual tensors (`torch.autograd.forward_ad`); a tape operator inside
f detaches its inputs, which would drop the tangent, so that case is redone by
`torch.func.jvp`. Compared with the analytic second derivative of sum(sin(x)^2).
"""

from __future__ import annotations

import torch

import activity as ad
from activity import Active, Constant
from activity.testing import assert_tree_allclose

TORCH = ad.AutoTorch()


def _loss(x: torch.Tensor) -> torch.Tensor:
    return torch.sum(torch.sin(x) ** 2)  # gradient sin(2x), Hessian diag(2 cos(2x))


def test_pushforward_of_a_gradient_inside_f():
    x, t = torch.tensor([0.3, 0.7, -1.1]), torch.tensor([1.0, -2.0, 0.5])
    got = ad.pushforward(lambda v: ad.gradient(_loss, Active(v), backend=TORCH), Active(x), tangent=t, backend=TORCH)
    assert_tree_allclose(got, 2 * torch.cos(2 * x) * t, rtol=1e-5, atol=1e-6)
    assert torch.equal(x, torch.tensor([0.3, 0.7, -1.1]))  # the point was left as it was


def test_pushforward_of_a_prepared_pullback_inside_f():
    x, t = torch.tensor([0.3, 0.7]), torch.tensor([2.0, 1.0])
    ct = torch.tensor(3.0)
    pullback = ad.prepare(ad.pullback, _loss, Active(x), backend=TORCH, cotangent=ct)

    def gradient_times(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return pullback(v, cotangent=scale)

    got = ad.pushforward(gradient_times, Active(x), Constant(ct), tangent=t, backend=TORCH)
    assert_tree_allclose(got, 3.0 * 2 * torch.cos(2 * x) * t, rtol=1e-5, atol=1e-6)
    # the plain forward mode of f itself (no tape operator inside) still gives the same numbers
    plain = ad.pushforward(lambda v: torch.sin(2 * v) * 3.0, Active(x), tangent=t, backend=TORCH)
    assert_tree_allclose(plain, got, rtol=1e-5, atol=1e-6)


def test_pushforward_in_the_data_of_a_module_gradient_inside_f():
    """The tangent is in the data the inner gradient takes as a Constant: a mixed second
    derivative (how a module's gradient moves with its input), on every call of a prepared
    inner gradient, whose view and tape leaves are kept between calls."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh(), torch.nn.Linear(2, 1))
    x, t = torch.randn(4, 3), torch.randn(4, 3)
    params = dict(model.named_parameters())

    def loss(m, x):
        return m(x).pow(2).mean()

    inner = ad.prepare(ad.gradient, loss, Active(model), Constant(x), backend=TORCH)
    want = torch.func.jvp(
        lambda x: torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).pow(2).mean())(params), (x,), (t,)
    )[1]
    for _ in range(3):
        got = ad.pushforward(lambda x: inner(model, x), Active(x), tangent=t, backend=TORCH)
        assert_tree_allclose(got, want, rtol=1e-5, atol=1e-6)

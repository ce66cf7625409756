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

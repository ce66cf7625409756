"""`activity.testing.check`: passes right layers, names what is wrong in wrong ones."""

from __future__ import annotations

import attrs
import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
import torch
from flax import nnx

import activity as ad
from activity import Active, Constant
from activity.testing import check


def generator(seed):
    return torch.Generator().manual_seed(seed)


def test_a_right_torch_layer_passes_every_applicable_check():
    layer = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3, generator=generator(0))
    report = check(lambda m, x: torch.tanh(m(x)).pow(2).sum(), Active(layer), Constant(x))
    names = " ".join(report.passed)
    for operator in ("pushforward", "pullback", "gradient", "hvp", "jacobian", "hessian", "gradient_and_hvp", "tangents=[...]"):
        assert operator in names, operator
    assert not report.failed and not report.unreliable


def test_right_equinox_and_nnx_layers_pass():
    mlp = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0))  # 26 parameters: the reference Hessian is 26 x 26
    assert not check(lambda m, x: jnp.sum(jax.vmap(m)(x) ** 2), Active(mlp), Constant(jnp.ones((4, 3)))).failed
    linear = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    assert not check(lambda m, x: jnp.tanh(m(x)), Active(linear), Constant(jnp.ones((4, 3))), operators=["pullback", "pushforward"]).failed


class OnePercentSine(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return torch.sin(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * torch.cos(x) * 1.01


def test_a_planted_error_in_a_custom_function_fails_naming_the_operator():
    x = torch.randn(5, dtype=torch.float64, generator=generator(1))
    with pytest.raises(AssertionError) as info:
        check(lambda x: OnePercentSine.apply(x).sum(), Active(x))
    message = str(info.value)
    assert "gradient, u0> on AutoTorch() vs reference" in message and "max rel error 0.01" in message


def test_a_planted_error_in_a_custom_vjp_fails():
    @jax.custom_vjp
    def square(x):
        return x**2

    square.defvjp(lambda x: (x**2, x), lambda x, g: (2.02 * x * g,))
    with pytest.raises(AssertionError, match=r"pullback\(v0\), u0> on AutoJAX\(\)"):
        check(lambda x: jnp.sum(square(x)), Active(jnp.ones(3)), operators=["pullback", "gradient"])


@attrs.frozen
class NoisyTorch(ad.AutoTorch):
    """Right on average, different on every call: what a nondeterministic kernel looks like."""

    def finalize(self, result, problem):
        result = super().finalize(result, problem)
        return torch.utils._pytree.tree_map(lambda t: t * (1 + 1e-3 * torch.rand(())), result)


def test_a_nondeterministic_backend_is_caught():
    with torch.random.fork_rng():
        with pytest.raises(AssertionError, match="two runs disagree"):
            check(lambda x: torch.sin(x).sum(), Active(torch.ones(3, dtype=torch.float64)), backends=NoisyTorch())


def test_a_float32_f_makes_the_reference_unreliable_not_the_backend_wrong():
    x = torch.tensor([1e3, 2e3, 3e3], dtype=torch.float64)
    f = lambda x: (x.float() ** 3).sum()  # noqa: E731  # a .float() inside, as HF causal-LM losses do
    report = check(f, Active(x), operators=["gradient"])
    assert not report.failed
    assert report.unreliable and "lower precision than the float64 reference" in report.unreliable[0]


def test_operators_that_do_not_apply_are_refused():
    with pytest.raises(ValueError, match="scalar output"):
        check(lambda x: torch.sin(x), Active(torch.ones(3)), operators=["hessian"])


def test_a_reference_hvp_at_a_kink_of_the_gradient_is_undecided_not_a_failure():
    """sum(relu(x)**2) is smooth, its gradient 2 relu(x) has a kink at 0: the reference's hvp
    (finite differences of the gradient) averages both sides there, torch takes relu'(0) = 0.
    The reference's warning from that hvp once escaped check(), which failed AutoTorch."""
    import torch

    x = torch.tensor([0.0, 1.0, -1.0], dtype=torch.float64)
    report = check(lambda x: (torch.relu(x) ** 2).sum(), Active(x), operators=["hvp"])
    assert not report.failed and report.unreliable and "kink" in report.unreliable[0]
    off = torch.tensor([0.5, 1.0, -1.0], dtype=torch.float64)  # away from the kink: decided, and right
    report = check(lambda x: (torch.relu(x) ** 2).sum(), Active(off), operators=["hvp"])
    assert report.passed and not report.unreliable and not report.failed


def test_a_reference_that_is_not_finite_at_a_domain_edge_is_undecided_not_a_failure():
    """sqrt at 0: a step leaves the domain, the reference gives nan where AD gives inf. Once a
    FAIL of a correct backend; now undecided, naming the cause. Inside the domain it passes."""
    import torch

    report = check(lambda x: torch.sqrt(x).sum(), Active(torch.tensor([0.0, 1.0, 4.0], dtype=torch.float64)), operators=["gradient"])
    assert not report.failed and report.unreliable and "not finite" in report.unreliable[0]
    report = check(lambda x: torch.sqrt(x).sum(), Active(torch.tensor([0.5, 1.0, 4.0], dtype=torch.float64)), operators=["gradient"])
    assert report.passed and not report.unreliable and not report.failed


def test_an_output_part_that_does_not_depend_on_the_active_argument_is_checked_with_the_rest():
    # A layer returning (a constant mask, its activation): check() evaluates f's output through
    # the backend; a first output cut from the Active argument must not read as f being cut.
    x = torch.randn(3, dtype=torch.float64, generator=generator(1))
    report = check(lambda x: (torch.ones(2, dtype=torch.float64), torch.tanh(x)), Active(x), backends=ad.AutoTorch())
    assert report.passed and not report.failed

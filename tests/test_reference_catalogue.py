"""The finite-difference reference on operators from real catalogues (torch's OpInfo, jnp / lax / jax.nn).

A sweep of 829 OpInfo samples and 104 JAX functions (AutoFiniteDifferences against
torch.autograd.functional.jacobian / jax.jacrev in float64) found where the reference was
silently wrong or could not decide; these are the representatives. Every expected value is
analytic or a raw AD call, never the reference itself.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import numpy as np
import pytest
import torch

import activity as ad
from activity import Active
from activity.backends._finite_differences import (
    ReferenceKinkWarning,
    ReferenceNondeterminismWarning,
    ReferenceQuantizedWarning,
    ReferenceUnreliableWarning,
)
from activity.testing import check

FD = ad.AutoFiniteDifferences()


def reference_jacobian(f: Callable[..., Any], x: Any) -> tuple[Any, set[type[Warning]]]:
    """The reference's Jacobian of ``f`` at ``x`` and the kinds of unreliability it warned of."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jacobian = ad.jacobian(f, Active(x), backend=FD)
    return jacobian, {w.category for w in caught if issubclass(w.category, ReferenceUnreliableWarning)}


def f64(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# -- random draws: every evaluation of f sees the same ones ---------------------------------


def test_torch_draws_are_the_same_at_every_step_and_the_caller_state_is_as_after_one_call() -> None:
    x = f64(1.0, 2.0, 3.0)

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x * torch.rand(3, dtype=torch.float64)).sum()

    torch.manual_seed(0)
    draws = torch.rand(3, dtype=torch.float64)  # d/dx of x . draws is the draws
    after_one_call = torch.get_rng_state()
    torch.manual_seed(0)
    gradient = ad.gradient(f, Active(x), backend=FD)
    torch.testing.assert_close(gradient, draws, rtol=1e-9, atol=1e-12)
    assert torch.equal(torch.get_rng_state(), after_one_call)


@pytest.mark.parametrize("gaussian_cached", [False, True], ids=["no_cached_gaussian", "a_cached_gaussian"])
@pytest.mark.parametrize("draw", ["rand", "standard_normal"])
def test_numpy_global_draws_are_the_same_at_every_step(draw: str, gaussian_cached: bool) -> None:
    # Legacy Gaussians come in pairs: with one cached, f's single draw takes it without moving the
    # generator's words, which the reference must restore all the same.
    def start() -> None:
        np.random.seed(3)
        if gaussian_cached:
            np.random.standard_normal()

    start()
    draws = getattr(np.random, draw)(1)
    after_one_call = np.random.get_state()
    start()
    gradient = ad.gradient(lambda x: (x * getattr(np.random, draw)(1)).sum(), Active(np.array([1.0, 2.0, 3.0])), backend=FD)
    np.testing.assert_allclose(gradient, np.repeat(draws, 3), rtol=1e-9)
    after = np.random.get_state()
    assert after[0] == after_one_call[0] and np.array_equal(after[1], after_one_call[1]) and after[2:] == after_one_call[2:]


def test_normal_is_differentiated_along_its_draw_where_torch_defines_zero() -> None:
    # OpInfo "normal": torch's rule gives d normal(mean, std) / d mean = 0; with the draw held,
    # mean + std * z moves one for one with mean (before, the reference differenced new draws).
    mean = f64(0.5, -1.0, 2.0)
    torch.manual_seed(1)
    jacobian, unreliable = reference_jacobian(lambda m: torch.normal(m, 0.3), mean)
    torch.testing.assert_close(jacobian, torch.eye(3, dtype=torch.float64), rtol=1e-8, atol=1e-10)
    assert not unreliable


def test_f_with_a_generator_of_its_own_is_reported_and_check_does_not_blame_the_backend() -> None:
    generator = torch.Generator().manual_seed(0)

    def noisy(x: torch.Tensor) -> torch.Tensor:
        return (x * (1 + 1e-3 * torch.rand(3, generator=generator, dtype=torch.float64))).sum()

    _, unreliable = reference_jacobian(noisy, f64(1.0, 2.0, 3.0))
    assert ReferenceNondeterminismWarning in unreliable
    # The kit fails f's own nondeterminism (two runs of the backend disagree), and no comparison
    # with the reference: those are "reference unreliable".
    with pytest.raises(AssertionError) as failure:
        check(noisy, Active(f64(1.0, 2.0, 3.0)), backends=ad.AutoTorch())
    failed = [line for line in str(failure.value).splitlines() if line.lstrip().startswith("FAIL")]
    assert failed and not [line for line in failed if "reference" in line]
    assert "reference unreliable: f returns different values on the same inputs" in str(failure.value)


def test_a_deterministic_f_is_not_reported_as_varying() -> None:
    _, unreliable = reference_jacobian(lambda x: torch.tanh(x) * x, f64(0.3, -1.2))
    assert not unreliable


# -- kinks at the point: reported, not blamed on the backend --------------------------------


@pytest.mark.parametrize(
    ("name", "f", "x"),
    [
        ("abs at 0", torch.abs, f64(0.0, 1.0)),
        ("relu at 0", torch.relu, f64(0.0, -1.0)),
        ("tied maxima", lambda x: x.max(), f64(1.0, 1.0, 0.5)),
        ("clamp at its bound", lambda x: x.clamp(-0.5, 0.5), f64(0.5, 0.2)),
        ("norm at 0", torch.linalg.vector_norm, f64(0.0, 0.0)),
    ],
)
def test_a_kink_at_the_point_is_reported(name: str, f: Callable[..., Any], x: torch.Tensor) -> None:
    _, unreliable = reference_jacobian(f, x)
    assert ReferenceKinkWarning in unreliable, name


@pytest.mark.parametrize(
    ("name", "f", "x", "expected"),
    [
        ("relu 1e-3 from its kink", torch.relu, f64(1e-3, -1e-3), torch.diag(f64(1.0, 0.0))),
        ("relu 1e-5 from its kink", torch.relu, f64(1e-5), f64(1.0)[None]),
        ("x**2", lambda x: x**2, f64(0.3, 2.0), torch.diag(f64(0.6, 4.0))),
        ("x**4 at 0", lambda x: x**4, f64(0.0), f64(0.0)[None]),
        ("sin(1000 x)", lambda x: torch.sin(1e3 * x), f64(0.1), 1e3 * torch.cos(f64(100.0))[None]),
        ("exp(30)", torch.exp, f64(30.0), torch.exp(f64(30.0))[None]),
        ("max without a tie", lambda x: x.max(), f64(1.0, 0.999, 0.5), f64(1.0, 0.0, 0.0)),
    ],
)
def test_smooth_points_are_not_reported_as_kinks(name: str, f: Callable[..., Any], x: torch.Tensor, expected: torch.Tensor) -> None:
    jacobian, unreliable = reference_jacobian(f, x)
    assert not unreliable, name
    torch.testing.assert_close(jacobian.reshape(expected.shape), expected, rtol=1e-7, atol=1e-9)


# -- staircases: f rounding coarser than its dtype -----------------------------------------


_STAIRCASES = {
    "round to 3 decimals": lambda x: torch.round(x, decimals=3),
    "round to 4 decimals": lambda x: torch.round(x, decimals=4),
    "floor to 1e-4": lambda x: torch.floor(x * 1e4) / 1e4,
}


@pytest.mark.parametrize("f", _STAIRCASES.values(), ids=_STAIRCASES.keys())
def test_a_staircase_is_reported_where_the_steps_see_its_average_slope(f: Callable[..., Any]) -> None:
    # Its derivative is 0 between the jumps (what torch gives); at the steps above its quanta the
    # differences see the staircase's slope (about 1): silently wrong before. (Quanta as coarse
    # as the steps, floor(100 x), give differences of 0: right, and not reported.)
    x = f64(0.3217, -1.4562, 0.7771)
    jacobian, unreliable = reference_jacobian(f, x)
    assert jacobian.abs().max() > 0.1  # what made it wrong: the reference sees a slope
    assert unreliable & {ReferenceQuantizedWarning, ReferenceKinkWarning}  # a floor's jumps can also look like kinks
    report = check(lambda x: f(x).sum(), Active(x), backends=ad.AutoTorch())
    assert report.unreliable and not report.failed


def test_a_staircase_is_named_as_such() -> None:
    _, unreliable = reference_jacobian(lambda x: torch.round(x, decimals=3), f64(0.3217, -1.4562))
    assert unreliable == {ReferenceQuantizedWarning}
    report = check(lambda x: torch.round(x, decimals=3).sum(), Active(f64(0.3217, -1.4562)), backends=ad.AutoTorch())
    assert "piecewise constant" in report.unreliable[0]


@pytest.mark.parametrize(
    ("name", "f", "x", "expected"),
    [
        ("a staircase times x", lambda x: torch.round(x * 64) / 64 * x, f64(0.3217), torch.round(f64(0.3217) * 64) / 64),
        ("large inputs", lambda x: x * 3.0, f64(1e7, -3e9), torch.diag(f64(3.0, 3.0))),
        ("saturated tanh", torch.tanh, f64(20.0), (1 - torch.tanh(f64(20.0)) ** 2)[None]),
        ("float32 inside f", lambda x: torch.sin(x.float()).double(), f64(0.4), torch.cos(f64(0.4))[None]),
    ],
)
def test_functions_that_move_are_not_reported_as_staircases(name: str, f: Callable[..., Any], x: torch.Tensor, expected: torch.Tensor) -> None:
    jacobian, unreliable = reference_jacobian(f, x)
    assert ReferenceQuantizedWarning not in unreliable, name
    torch.testing.assert_close(jacobian.reshape(expected.shape), expected, rtol=1e-4, atol=1e-9)


def test_check_at_a_relu_kink_says_reference_unreliable_instead_of_failing_autotorch() -> None:
    # torch takes relu'(0) = 0; the central differences give 1/2: neither is wrong.
    report = check(lambda x: torch.relu(x).sum(), Active(f64(0.0, 1.0)), backends=ad.AutoTorch())
    assert report.unreliable and not report.failed


def test_a_wrong_gradient_is_still_caught_just_off_a_kink() -> None:
    class HalfRelu(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(x)
            return torch.relu(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            (x,) = ctx.saved_tensors
            return grad * (x > 0) * 0.99  # 1% off

    with pytest.raises(AssertionError, match="failed"):
        check(lambda x: HalfRelu.apply(x).sum(), Active(f64(0.2, 1.0)), backends=ad.AutoTorch())


def test_jax_kinks_are_reported_and_smooth_functions_match_jacrev() -> None:
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import jax.scipy.special as jss

    enable_x64 = jax.enable_x64 if hasattr(jax, "enable_x64") else jax.experimental.enable_x64
    with enable_x64(True):
        x = jnp.asarray([0.0, 1.0])
        _, unreliable = reference_jacobian(jnp.abs, x)
        assert ReferenceKinkWarning in unreliable
        smooth = jnp.asarray([0.7, 1.3, 2.1])
        for f in (jnp.tanh, jss.logsumexp, jss.gammaln, jss.digamma, jax.nn.softmax, lambda v: jnp.linalg.norm(v) ** 3):
            jacobian, unreliable = reference_jacobian(f, smooth)
            assert not unreliable
            np.testing.assert_allclose(np.asarray(jacobian), np.asarray(jax.jacrev(f)(smooth)), rtol=1e-7, atol=1e-9)


# -- outputs that are not finite spoil only their own rows ---------------------------------


def test_an_infinite_output_spoils_only_its_own_jacobian_row() -> None:
    # OpInfo masked.log_softmax: masked entries are -inf, and the reference's Jacobian (pulled
    # back row by row) came out nan everywhere, the finite outputs' rows too.
    mask = torch.tensor([True, True, False, True, False])

    def masked_log_softmax(x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(torch.where(mask, x, -torch.inf), 0)

    x = f64(-4.8, -7.6, -0.6, -1.5, -2.0)
    jacobian, _ = reference_jacobian(masked_log_softmax, x)
    expected = torch.autograd.functional.jacobian(masked_log_softmax, x)
    torch.testing.assert_close(jacobian[mask], expected[mask], rtol=1e-7, atol=1e-9)
    assert torch.isnan(jacobian[~mask]).all()  # no derivative of an infinite value


# -- where torch's own rule is not the derivative, the reference is right -------------------


def test_eigvalsh_reads_one_triangle_and_the_reference_says_so() -> None:
    # OpInfo linalg.eigvalsh: torch's rule is the derivative along symmetric perturbations; the
    # function reads only the lower triangle, which the raw AD of the symmetrised input shows.
    a = torch.randn(3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def lower_only(x: torch.Tensor) -> torch.Tensor:
        lower = torch.tril(x)
        return torch.linalg.eigvalsh(lower + torch.tril(x, -1).T)

    jacobian, unreliable = reference_jacobian(torch.linalg.eigvalsh, a)
    assert not unreliable
    torch.testing.assert_close(jacobian, torch.autograd.functional.jacobian(lower_only, a), rtol=1e-6, atol=1e-8)


def test_a_hessian_of_rounding_noise_is_reference_unreliable_not_a_failure() -> None:
    # jnp sweep, "sum_1e8" on float32 inputs: the reference's Hessian differences its own
    # gradient, whose rounding noise (f is 1e8 in float64) no step smooths out; AutoJAX is right.
    pytest.importorskip("jax")
    import jax.numpy as jnp

    f, x = (lambda x: (x**2).sum() + 1e8), jnp.asarray([0.3, -1.2, 0.7], dtype=jnp.float32)
    with pytest.warns(ReferenceUnreliableWarning, match="noisy"):
        ad.hessian(f, Active(x), backend=ad.AutoFiniteDifferences())
    # check's Hessian reference differences AutoJAX's gradient (exact here), as its hvp does: decided
    report = check(f, Active(x), operators=["hessian"])
    assert report.passed == ["hessian on AutoJAX() vs the reference's derivative of the gradient"] and not report.unreliable

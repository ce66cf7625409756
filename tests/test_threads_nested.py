"""Prepared objects under threads, activity inside outer transforms, and NaN/inf passing through."""

from __future__ import annotations

import copy
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import activity as ad
from activity import Active, Constant

THREADS = 8


def run_in_threads(work, inputs):
    """Call ``work(input)`` from one thread per input, all released at once; collect results or errors."""
    barrier = threading.Barrier(len(inputs))
    results, errors = [None] * len(inputs), []

    def target(i):
        try:
            barrier.wait()
            results[i] = [work(inputs[i]) for _ in range(5)]  # several calls each, overlapping
        except Exception as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def test_prepared_jax_gradient_from_eight_threads():
    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    w = jnp.array([0.3, -0.2, 0.5])
    xs = [jnp.asarray(np.random.default_rng(i).standard_normal((4, 3)), dtype=jnp.float32) for i in range(THREADS)]
    prep = ad.prepare(ad.gradient, loss, Active(w), Constant(jnp.zeros((4, 3))))
    results = run_in_threads(lambda x: prep(w, x), xs)
    for x, per_thread in zip(xs, results):
        x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
        t = np.tanh(x64 @ w64)
        expected = x64.T @ (2 * t * (1 - t**2))  # analytic
        for g in per_thread:
            np.testing.assert_allclose(np.asarray(g), expected, rtol=1e-5, atol=1e-6)


def test_prepared_torch_module_gradient_from_eight_threads():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    state = copy.deepcopy(model.state_dict())

    def loss(model, x):
        return model(x).pow(2).mean()

    xs = [torch.randn(6, 3, generator=torch.Generator().manual_seed(i)) for i in range(THREADS)]
    expected = []
    for x in xs:  # hand-written autograd, one thread, on copies (train-mode BatchNorm moves statistics)
        twin = copy.deepcopy(model)
        expected.append(torch.autograd.grad(loss(twin, x), list(twin.parameters())))
    prep = ad.prepare(ad.gradient, loss, Active(model), Constant(torch.zeros(6, 3)))
    results = run_in_threads(lambda x: prep(model, x), xs)
    for want, per_thread in zip(expected, results):
        for got in per_thread:
            for g, e in zip(got.values(), want):
                torch.testing.assert_close(g, e)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), f"{k} changed"
    assert all(p.grad is None for p in model.parameters())


def test_prepared_finite_differences_from_eight_threads():
    prep = ad.prepare(ad.gradient, lambda w, x: np.sum(np.sin(w * x)), Active(np.ones(3)), Constant(np.zeros(3)),
                      backend=ad.AutoFiniteDifferences())
    xs = [np.random.default_rng(i).standard_normal(3) for i in range(THREADS)]
    w = np.array([0.5, -1.0, 2.0])
    results = run_in_threads(lambda x: prep(w, x), xs)
    for x, per_thread in zip(xs, results):
        for g in per_thread:
            np.testing.assert_allclose(g, x * np.cos(w * x), rtol=1e-8)


# ------------------------------------------------------------------ nested


def test_no_perturbation_confusion_in_jax():
    # d/dx [ x * d/dy (x + y) ] = d/dx [x * 1] = 1; confusing the two perturbations gives 2.
    def outer(x):
        inner = ad.derivative(lambda y, x: x + y, Active(jnp.array(1.0)), Constant(x), backend=ad.AutoJAX())
        return x * inner

    assert float(jax.grad(outer)(jnp.array(3.0))) == pytest.approx(1.0)


def test_no_perturbation_confusion_in_torch_func():
    def outer(x):
        inner = ad.derivative(lambda y, x: x + y, Active(torch.tensor(1.0)), Constant(x), backend=ad.AutoTorch())
        return x * inner

    assert float(torch.func.grad(outer)(torch.tensor(3.0))) == pytest.approx(1.0)


@pytest.mark.parametrize("op", ["gradient", "hvp", "pullback"])
def test_activity_inside_torch_func_grad_with_a_constant_tracer(op):
    w = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)

    def outer(c):
        f = lambda w, c: (w * c).pow(2).sum()  # noqa: E731  gradient in w: 2 w c^2
        if op == "gradient":
            g = ad.gradient(f, Active(w), Constant(c))
        elif op == "hvp":  # Hessian 2 c^2 I, along ones
            g = ad.hvp(f, Active(w), Constant(c), tangent=torch.ones(3, dtype=torch.float64)) * w
        else:
            g = ad.pullback(lambda w, c: (w * c) ** 2, Active(w), Constant(c), cotangent=torch.ones(3, dtype=torch.float64))
        return g.sum()

    c = torch.tensor([1.5, 0.5, -2.0], dtype=torch.float64)
    # each variant sums 2 w c^2 (gradient, pullback) or 2 c^2 * w (hvp along ones, times w): d/dc = 4 w c
    torch.testing.assert_close(torch.func.grad(outer)(c), 4 * w * c)


def test_activity_inside_jax_jit_and_vmap():
    def per_example(x):
        return ad.gradient(lambda w, x: jnp.sum((w * x) ** 2), Active(jnp.ones(2)), Constant(x), backend=ad.AutoJAX())

    xs = jnp.array([[1.0, 2.0], [3.0, 4.0]])
    np.testing.assert_allclose(jax.jit(jax.vmap(per_example))(xs), 2 * np.asarray(xs) ** 2, rtol=1e-6)


# ------------------------------------------------------------------ nan and inf


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_nan_and_inf_pass_through_ad_backends(backend):
    if backend == "jax":
        x, b = jnp.array([1.0, jnp.nan, 2.0]), ad.AutoJAX()
        sq = lambda x: x**2  # noqa: E731
    else:
        x, b = torch.tensor([1.0, float("nan"), 2.0]), ad.AutoTorch()
        sq = lambda x: x**2  # noqa: E731
    g = np.asarray(ad.gradient(lambda x: (x**2).sum(), Active(x), backend=b))
    assert g[0] == 2.0 and np.isnan(g[1]) and g[2] == 4.0
    value, _ = ad.value_and_gradient(lambda x: (x**2).sum(), Active(x), backend=b)
    assert np.isnan(float(value))
    jac = np.asarray(ad.jacobian(sq, Active(x), backend=b))
    assert np.isnan(jac[1, 1]) and jac[0, 0] == 2.0
    big = x * 0 + float("inf") if backend == "torch" else x * 0 + jnp.inf
    value = ad.value_and_gradient(lambda x: x.sum(), Active(big), backend=b)[0]
    assert np.isinf(float(value)) or np.isnan(float(value))


def test_nan_is_not_masked_by_finite_differences():
    x = np.array([1.0, np.nan])
    g = ad.gradient(lambda x: np.sum(x**2), Active(x), backend=ad.AutoFiniteDifferences())
    assert np.isnan(g).all()  # every perturbed sum is nan: the reference says so instead of inventing numbers
    with np.errstate(divide="ignore"):
        value = ad.value_and_derivative(lambda t: t / 0.0, Active(1.0), backend=ad.AutoFiniteDifferences())[0]
    assert np.isinf(value)


@pytest.mark.parametrize("outer", ["jacobian", "pullback"])
def test_torch_reverse_mode_over_an_inner_operator(outer):
    """The inner operator's torch result stays on the outer pass's tape (see
    tests/test_composition.py for the whole matrix): an outer reverse pass differentiates it,
    as the Hessian and the forward pass over it do."""
    x = torch.tensor([1.0, 2.0], dtype=torch.float64)
    f = lambda x: (x**3).sum()  # noqa: E731  Hessian diag(6 x)
    inner = lambda x: ad.gradient(f, Active(x))  # noqa: E731
    seed = {} if outer == "jacobian" else {"cotangent": torch.ones(2, dtype=torch.float64)}
    expected = torch.diag(6 * x) if outer == "jacobian" else 6 * x
    torch.testing.assert_close(getattr(ad, outer)(inner, Active(x), **seed), expected)
    torch.testing.assert_close(ad.hessian(f, Active(x)), torch.diag(6 * x))
    torch.testing.assert_close(ad.pushforward(inner, Active(x), tangent=torch.ones(2, dtype=torch.float64)), 6 * x)

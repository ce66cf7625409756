"""`SecondOrder(outer, inner)`: second-order operators as ``outer`` over ``inner``, against analytic results."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import activity as ad
from activity import Active, Constant

FD, JAX = ad.AutoFiniteDifferences(), ad.AutoJAX()


def f32(x):
    return jnp.asarray(x, jnp.float32)


COMBOS = {
    # outer FD over inner JAX: JAX evaluated in float64 under FD's context, results rounded to float32
    "FD-over-JAX": (ad.SecondOrder(FD, JAX), f32, dict(rtol=2e-6, atol=2e-6), "jax", np.float32),
    "JAX-over-JAX": (ad.SecondOrder(JAX, JAX), f32, dict(rtol=1e-5, atol=1e-5), "jax", np.float32),
    "FD-over-FD": (ad.SecondOrder(FD, FD), np.asarray, dict(rtol=1e-8, atol=1e-8), "numpy", np.float64),
}


def xp_of(*xs):
    return jnp if any(isinstance(x, jax.Array) for x in xs) else np


def np64(tree):
    return jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64) if hasattr(a, "dtype") else a, tree)


# ---------------------------------------------------------------- one Active, one Constant
# s(x, c) = sum(sin(c x)) + (x . c)^2 / 2


def s(x, c):
    xp = xp_of(x, c)
    return xp.sum(xp.sin(c * x)) + xp.sum(x * c) ** 2 / 2


def s_value(x, c):
    return np.sum(np.sin(c * x)) + (x @ c) ** 2 / 2


def s_grad(x, c):
    return c * np.cos(c * x) + (x @ c) * c


def s_hess(x, c):
    return -np.diag(c**2 * np.sin(c * x)) + np.outer(c, c)


# ---------------------------------------------------------------- a pytree Active and an array Active
# q(p, y) = sum(w^2 y) + sum(sin y) * k, with p = {"w": w, "k": 2 (int)}


def q(p, y):
    xp = xp_of(p["w"], y)
    return xp.sum(p["w"] ** 2 * y) + xp.sum(xp.sin(y)) * p["k"]


def q_hess(w, y, k):
    """jax.hessian layout for two Active arguments: output structure (the gradient's), then a tuple over inputs."""
    return (
        {"w": ({"w": np.diag(2 * y), "k": None}, np.diag(2 * w)), "k": None},
        ({"w": np.diag(2 * w), "k": None}, -k * np.diag(np.sin(y))),
    )


def q_grad(w, y, k):
    return ({"w": 2 * w * y, "k": None}, w**2 + k * np.cos(y))


def q_hvp(w, y, k, t):
    tw, ty = t[0]["w"], t[1]
    return ({"w": 2 * y * tw + 2 * w * ty, "k": None}, 2 * w * tw - k * np.sin(y) * ty)


# ---------------------------------------------------------------- scalar inputs
# r(a, b) = [a^2 b, sin(a b)]


def r(a, b):
    xp = xp_of(a, b)
    return xp.stack([a * a * b, xp.sin(a * b)])


def r_d(a, b):
    return (np.array([2 * a * b, b * np.cos(a * b)]), np.array([a * a, a * np.cos(a * b)]))


def r_d2(a, b):
    ab = a * b
    cross = np.array([2 * a, np.cos(ab) - ab * np.sin(ab)])
    return (
        (np.array([2 * b, -b * b * np.sin(ab)]), cross),
        (cross, np.array([0.0, -a * a * np.sin(ab)])),
    )


MODES = [pytest.param(False, id="unprepared"), pytest.param(True, id="prepared")]


def run(op, f, args, backend, prepared, call_values, **kwargs):
    """Unprepared on ``args``' values, or prepared on ``args`` and called with ``call_values``."""
    if not prepared:
        return op(f, *[type(a)(v) for a, v in zip(args, call_values)], backend=backend, **kwargs)
    return ad.prepare(op, f, *args, backend=backend, **kwargs)(*call_values, **kwargs)


@pytest.mark.parametrize("prepared", MODES)
@pytest.mark.parametrize("combo", list(COMBOS))
def test_hessian_family_with_constant(combo, prepared, assert_tree_close, intact):
    backend, to, tol, framework, dtype = COMBOS[combo]
    rng = np.random.default_rng(0)
    prep_args = [Active(to(rng.uniform(-1, 1, 3))), Constant(to(rng.uniform(0.5, 1.5, 3)))]
    x, c = to(rng.uniform(-1, 1, 3)), to(rng.uniform(0.5, 1.5, 3))
    t1, t2 = to(rng.normal(size=3)), to(rng.normal(size=3))
    x64, c64, t164, t264 = np64((x, c, t1, t2))
    hess = s_hess(x64, c64)
    check = lambda got, want: assert_tree_close(got, want, **tol, framework=framework, dtype=dtype)  # noqa: E731

    with intact(x, c, t1, t2):
        check(run(ad.hessian, s, prep_args, backend, prepared, (x, c)), hess)
        check(run(ad.value_gradient_and_hessian, s, prep_args, backend, prepared, (x, c)),
              (s_value(x64, c64), s_grad(x64, c64), hess))
        check(run(ad.hvp, s, prep_args, backend, prepared, (x, c), tangent=t1), hess @ t164)
        check(run(ad.hvp, s, prep_args, backend, prepared, (x, c), tangents=[t1, t2]), [hess @ t164, hess @ t264])
        check(run(ad.gradient_and_hvp, s, prep_args, backend, prepared, (x, c), tangent=t2),
              (s_grad(x64, c64), hess @ t264))
        # First-order operators run on the inner backend.
        check(run(ad.gradient, s, prep_args, backend, prepared, (x, c)), s_grad(x64, c64))


@pytest.mark.parametrize("prepared", MODES)
@pytest.mark.parametrize("combo", list(COMBOS))
def test_hessian_family_with_pytree_and_several_actives(combo, prepared, assert_tree_close, intact):
    backend, to, tol, framework, dtype = COMBOS[combo]
    rng = np.random.default_rng(1)
    prep_args = [Active({"w": to(rng.uniform(-1, 1, 2)), "k": 2}), Active(to(rng.uniform(-1, 1, 2)))]
    p, y = {"w": to(rng.uniform(-1, 1, 2)), "k": 2}, to(rng.uniform(-1, 1, 2))
    t = ({"w": to(rng.normal(size=2)), "k": None}, to(rng.normal(size=2)))
    w64, y64 = np64((p["w"], y))
    t64 = np64(t)
    check = lambda got, want: assert_tree_close(got, want, **tol, framework=framework, dtype=dtype)  # noqa: E731

    with intact(p, y, t):
        check(run(ad.hessian, q, prep_args, backend, prepared, (p, y)), q_hess(w64, y64, 2))
        check(run(ad.gradient_and_hvp, q, prep_args, backend, prepared, (p, y), tangents=[t]),
              (q_grad(w64, y64, 2), [q_hvp(w64, y64, 2, t64)]))


def test_hessian_layout_matches_raw_jax_hessian(assert_tree_close):
    """For float-only pytrees the layout is exactly jax.hessian(argnums=(0, 1))'s."""
    rng = np.random.default_rng(2)
    w, y = f32(rng.uniform(-1, 1, 2)), f32(rng.uniform(-1, 1, 2))

    def g(p, y):
        return jnp.sum(p["w"] ** 2 * y) + jnp.sum(jnp.sin(y)) * p["k"]

    p = {"w": w, "k": jnp.float32(2.0)}
    raw = jax.hessian(g, argnums=(0, 1))(p, y)
    for backend in (ad.SecondOrder(FD, JAX), ad.SecondOrder(JAX, JAX), JAX):
        got = ad.hessian(g, Active(p), Active(y), backend=backend)
        assert_tree_close(got, jax.tree_util.tree_map(np.asarray, raw), rtol=2e-5, atol=2e-5, framework="jax")


@pytest.mark.parametrize("prepared", MODES)
@pytest.mark.parametrize("combo", list(COMBOS))
def test_second_derivative_family(combo, prepared, assert_tree_close, intact):
    backend, to, tol, framework, dtype = COMBOS[combo]
    rng = np.random.default_rng(3)
    prep_args = [Active(to(np.asarray(rng.uniform(0.3, 1.2)))), Active(to(np.asarray(rng.uniform(0.3, 1.2))))]
    a, b = to(np.asarray(rng.uniform(0.3, 1.2))), to(np.asarray(rng.uniform(0.3, 1.2)))
    a64, b64 = np64((a, b))
    value = np.array([a64 * a64 * b64, np.sin(a64 * b64)])
    check = lambda got, want: assert_tree_close(got, want, **tol, framework=framework, dtype=dtype)  # noqa: E731
    with intact(a, b):
        check(run(ad.second_derivative, r, prep_args, backend, prepared, (a, b)), r_d2(a64, b64))
        check(run(ad.value_derivative_and_second_derivative, r, prep_args, backend, prepared, (a, b)),
              (value, r_d(a64, b64), r_d2(a64, b64)))


def test_fd_over_jax_restores_float32_mode(assert_tree_close):
    """Finite differences enable float64 only for the call: the global JAX mode is unchanged."""
    before = jax.config.jax_enable_x64
    ad.hessian(s, Active(f32([0.1, 0.2, 0.3])), Constant(f32([1.0, 1.0, 1.0])), backend=ad.SecondOrder(FD, JAX))
    assert jax.config.jax_enable_x64 == before
    assert jnp.ones(1).dtype == jnp.float32


@pytest.mark.parametrize("combo", list(COMBOS))
def test_hessian_and_hvp_through_a_cache(combo, assert_tree_close):
    """f writes x**2 into a Cache and reads it back: s = sum(x^2 sin x) + x0^2 x1^2."""
    backend, to, tol, framework, dtype = COMBOS[combo]

    def f(x, buf):
        xp = xp_of(x, buf)
        if isinstance(buf, np.ndarray):
            buf[...] = x**2
        else:
            buf = buf.at[...].set(x**2)
        return xp.sum(buf * xp.sin(x)) + buf[0] * buf[1]

    rng = np.random.default_rng(4)
    x, t = to(rng.uniform(-1, 1, 3)), to(rng.normal(size=3))
    buf = to(rng.normal(size=3) * 1e3)
    x64, t64 = np64((x, t))
    h = np.diag(2 * np.sin(x64) + 4 * x64 * np.cos(x64) - x64**2 * np.sin(x64))
    h[0, 0] += 2 * x64[1] ** 2
    h[1, 1] += 2 * x64[0] ** 2
    h[0, 1] += 4 * x64[0] * x64[1]
    h[1, 0] += 4 * x64[0] * x64[1]
    check = lambda got, want: assert_tree_close(got, want, **tol, framework=framework, dtype=dtype)  # noqa: E731
    check(ad.hessian(f, Active(x), ad.Cache(buf), backend=backend), h)
    check(ad.hvp(f, Active(x), ad.Cache(buf), tangent=t, backend=backend), h @ t64)


# ---------------------------------------------------------------- mode: how the outer backend differentiates


@pytest.mark.parametrize("outer", ["JAX", "FD"])
def test_reverse_over_reverse_mode_matches_the_analytic_hessian(outer):
    backend = ad.SecondOrder(JAX if outer == "JAX" else FD, JAX, mode="reverse-over-reverse")
    x, c = f32([0.3, -0.7, 1.1]), f32([1.5, 0.5, -2.0])
    # s(x, c) = sum(sin(c x)) + (x . c)^2 / 2: H = diag(-c^2 sin(c x)) + c c^T
    expected = np.diag(-(np64(c) ** 2) * np.sin(np64(c) * np64(x))) + np.outer(np64(c), np64(c))
    tolerance = dict(rtol=1e-5, atol=1e-5) if outer == "JAX" else dict(rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np64(ad.hessian(s, Active(x), Constant(c), backend=backend)), expected, **tolerance)
    t = f32([1.0, 2.0, -1.0])
    np.testing.assert_allclose(np64(ad.hvp(s, Active(x), Constant(c), tangent=t, backend=backend)), expected @ np64(t), **tolerance)


def test_reverse_over_reverse_mode_on_torch_is_double_backward():
    import torch

    model = torch.nn.utils.weight_norm(torch.nn.Linear(3, 2))  # no forward-mode rule in torch
    x = torch.linspace(-1, 1, 12).reshape(4, 3)
    loss = lambda m, x: m(x).tanh().pow(2).sum()  # noqa: E731
    names, params = zip(*[(n, p) for n, p in model.named_parameters()])
    tangent = {n: torch.ones_like(p) for n, p in zip(names, params)}
    grads = torch.autograd.grad(loss(model, x), params, create_graph=True)
    expected = torch.autograd.grad(grads, params, [tangent[n] for n in names])
    backend = ad.SecondOrder(ad.AutoTorch(), ad.AutoTorch(), mode="reverse-over-reverse")
    got = ad.hvp(loss, Active(model), Constant(x), tangent=tangent, backend=backend)
    for name, want in zip(names, expected):
        torch.testing.assert_close(got[name], want)


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="forward-over-reverse"):
        ad.SecondOrder(JAX, JAX, mode="sideways")

"""`activity.prepare`: one-time work once, never stale, never recompiling on new data.

Expected values are analytic (numpy, float64) or a raw ``jax.grad`` /
``jax.jacfwd`` written out in the test.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import activity as ad
from activity import Active, Cache, Constant

JAX_TOL = dict(rtol=1e-5, atol=1e-5)
FD_TOL = dict(rtol=1e-8, atol=1e-8)


def f32(x) -> jax.Array:
    return jnp.asarray(x, dtype=jnp.float32)


def np64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def sech2(z):
    return 1.0 - np.tanh(z) ** 2


# ---------------------------------------------------------------- a least-squares loss


def loss(w, data):
    """0.5 * sum((tanh(X @ w) - y)**2) with data = (X, y)."""
    X, y = data
    r = jnp.tanh(X @ w) - y
    return 0.5 * jnp.sum(r * r)


def loss_grad(w, X, y):
    z = X @ w
    return X.T @ ((np.tanh(z) - y) * sech2(z))


# ---------------------------------------------------------------- no recompilation


def loss_hvp(w, X, y, t):
    """Hessian of 0.5 |tanh(Xw) - y|^2 times t: X^T diag(s^2 + r * (-2 tanh(z) s)) X t, s = sech^2(z)."""
    z = X @ w
    r, s = np.tanh(z) - y, sech2(z)
    return X.T @ ((s * s - 2 * r * np.tanh(z) * s) * (X @ t))


NO_RECOMPILE_OPS = [
    pytest.param(ad.gradient, {}, lambda w, X, y, s: loss_grad(w, X, y), id="gradient"),
    pytest.param(
        ad.value_and_gradient,
        {},
        lambda w, X, y, s: (0.5 * np.sum((np.tanh(X @ w) - y) ** 2), loss_grad(w, X, y)),
        id="value_and_gradient",
    ),
    pytest.param(
        ad.pullback,
        {"cotangent": ()},
        lambda w, X, y, s: s["cotangent"] * loss_grad(w, X, y),
        id="pullback",
    ),
    pytest.param(ad.hvp, {"tangent": (3,)}, lambda w, X, y, s: loss_hvp(w, X, y, s["tangent"]), id="hvp"),
]


def counted(f):
    """``f`` and the list it appends to on each run: under JAX, one entry per trace."""
    traces = []

    def counted_f(*args):
        traces.append(1)
        return f(*args)

    return counted_f, traces


@pytest.mark.parametrize("op, seed, expected", NO_RECOMPILE_OPS)
def test_new_constant_batches_never_recompile(op, seed, expected, assert_tree_close, intact):
    """A Python counter in f grows only when JAX traces; five new batches of data do not retrace."""
    counted_loss, traces = counted(loss)
    rng = np.random.default_rng(0)
    w = f32(rng.normal(size=3))

    def new_batch():
        return (f32(rng.normal(size=(5, 3))), f32(rng.normal(size=5)))

    def new_seed():
        return {k: f32(rng.normal(size=shape)) for k, shape in seed.items()}

    prepared = ad.prepare(op, counted_loss, Active(w), Constant(new_batch()), backend=ad.AutoJAX(), **new_seed())
    baseline = None
    for call in range(5):
        data, seeds = new_batch(), new_seed()
        args = (w, data) if call % 2 == 0 else (Active(w), Constant(data))  # raw or annotated: same program
        with intact(w, data, seeds):
            result = prepared(*args, **seeds)
        if baseline is None:
            baseline = len(traces)
            assert baseline > 0, "f was never traced: the counter cannot show a recompilation"
        assert len(traces) == baseline, f"call {call} retraced f: {len(traces) - baseline} new trace(s)"
        X, y = np64(data[0]), np64(data[1])
        assert_tree_close(
            result, expected(np64(w), X, y, {k: np64(v) for k, v in seeds.items()}), **JAX_TOL, framework="jax"
        )


def test_numpy_where_jax_was_prepared_is_accepted_like_jax_jit_does(assert_tree_close):
    """jax.jit runs numpy arrays of a prepared JAX array's shape and canonical dtype without
    recompiling; a prepared AutoJAX operator does the same, raw or annotated, and refuses float16."""
    counted_loss, traces = counted(loss)
    rng = np.random.default_rng(1)
    w = f32(rng.normal(size=3))
    data = (f32(rng.normal(size=(5, 3))), f32(rng.normal(size=5)))
    prepared = ad.prepare(ad.gradient, counted_loss, Active(w), Constant(data))
    traced_by_prepare = len(traces)
    X, y = rng.normal(size=(5, 3)), rng.normal(size=5)  # numpy float64: float32 to JAX
    for args in [(np.asarray(w), (X, y)), (Active(np.asarray(w)), Constant((X, y)))]:
        assert_tree_close(prepared(*args), loss_grad(np64(w), X, y), **JAX_TOL, framework="jax")
    assert len(traces) == traced_by_prepare
    with pytest.raises(ad.PreparationMismatchError, match=r"argument 1\b.*dtype float32, got .*dtype float16"):
        prepared(w, (X.astype(np.float16), y))


def test_numpy_constant_mutated_in_place_between_calls_is_not_stale(assert_tree_close):
    """The closure trap: data mutated in place between calls must be seen by the next call."""
    rng = np.random.default_rng(1)
    w = rng.normal(size=3)
    X, y = rng.normal(size=(4, 3)), rng.normal(size=4)

    def f(w, X, y):
        xp = jnp if isinstance(w, jax.Array) else np
        r = xp.tanh(X @ w) - y
        return 0.5 * xp.sum(r * r)

    for backend, tol, to in [(ad.AutoJAX(), JAX_TOL, f32), (ad.AutoFiniteDifferences(), FD_TOL, np64)]:
        prepared = ad.prepare(ad.gradient, f, Active(to(w)), Constant(X), Constant(y), backend=backend)
        first = prepared(to(w), X, y)
        assert_tree_close(first, loss_grad(np64(to(w)), X, y), **tol)
        X *= -2.0  # the user's buffer changes in place
        y[:] = rng.normal(size=4)
        second = prepared(to(w), X, y)
        assert_tree_close(second, loss_grad(np64(to(w)), X, y), **tol)


# ---------------------------------------------------------------- strict=False


@pytest.mark.parametrize("backend", ["AutoJAX", "AutoFiniteDifferences"])
def test_non_strict_reprepares_for_new_shapes_and_reuses_old_plans(backend, assert_tree_close):
    traces = []
    to, tol = (f32, JAX_TOL) if backend == "AutoJAX" else (np64, FD_TOL)
    xp = jnp if backend == "AutoJAX" else np

    def f(x, c):
        traces.append(1)
        return xp.sum(xp.sin(c * x))

    rng = np.random.default_rng(2)
    b = getattr(ad, backend)()
    prepared = ad.prepare(ad.gradient, f, Active(to(rng.normal(size=3))), Constant(to(rng.normal(size=3))),
                          backend=b, strict=False)

    def check(n):
        x, c = to(rng.normal(size=n)), to(rng.normal(size=n))
        assert_tree_close(prepared(x, c), np64(c) * np.cos(np64(c) * np64(x)), **tol)

    check(3)
    check(5)  # a new shape: prepared again, not an error
    check(3)
    if backend == "AutoJAX":
        count = len(traces)
        check(5)
        check(3)
        assert len(traces) == count, "going back to a known signature retraced f"


def test_non_strict_static_constant_change_is_not_stale(assert_tree_close):
    """A non-array Constant (a Python float, a string) is static under JIT: a new value must be honoured."""
    rng = np.random.default_rng(3)
    x = f32(rng.normal(size=3))

    def f(x, scale, mode):
        out = scale * jnp.sum(jnp.sin(x))
        return out if mode == "plain" else 2 * out

    prepared = ad.prepare(ad.gradient, f, Active(x), Constant(2.0), Constant("plain"), strict=False)
    for scale, mode in [(2.0, "plain"), (3.0, "plain"), (3.0, "double"), (2.0, "plain")]:
        factor = scale * (1 if mode == "plain" else 2)
        assert_tree_close(prepared(x, scale, mode), factor * np.cos(np64(x)), **JAX_TOL)


def test_non_strict_change_of_annotation_kind(assert_tree_close):
    """strict=False: Active(x), Active(y) then Active(x), Constant(y) gives the single-Active result."""
    rng = np.random.default_rng(4)
    x, y = f32(rng.normal(size=2)), f32(rng.normal(size=2))

    def f(x, y):
        return jnp.sum(x * x * y)

    prepared = ad.prepare(ad.gradient, f, Active(x), Active(y), strict=False)
    both = prepared(x, y)
    assert_tree_close(both, (2 * np64(x) * np64(y), np64(x) ** 2), **JAX_TOL)
    only_x = prepared(Active(x), Constant(y))
    assert_tree_close(only_x, 2 * np64(x) * np64(y), **JAX_TOL)


def test_non_strict_new_tangent_batch_size(assert_tree_close):
    rng = np.random.default_rng(5)
    x = f32(rng.normal(size=3))
    f = lambda x: jnp.sum(jnp.sin(x))  # noqa: E731
    prepared = ad.prepare(ad.pushforward, f, Active(x), tangents=[x, x], strict=False)
    ts = [f32(rng.normal(size=3)) for _ in range(3)]
    result = prepared(x, tangents=ts)
    assert_tree_close(result, [np.cos(np64(x)) @ np64(t) for t in ts], **JAX_TOL)


# ---------------------------------------------------------------- call conventions


def test_raw_and_annotated_arguments_can_be_mixed(assert_tree_close):
    rng = np.random.default_rng(6)
    w, c, buf = rng.normal(size=3), rng.normal(size=3), np.zeros(3)

    def f(w, c, buf):
        buf[:] = w * c
        return np.sum(buf**2)

    prepared = ad.prepare(ad.gradient, f, Active(w), Constant(c), Cache(buf), backend=ad.AutoFiniteDifferences())
    w2, c2 = rng.normal(size=3), rng.normal(size=3)
    expected = 2 * w2 * c2**2
    assert_tree_close(prepared(w2, Constant(c2), buf), expected, **FD_TOL)
    assert_tree_close(prepared(Active(w2), c2, Cache(np.ones(3))), expected, **FD_TOL)


def test_prepare_accepts_operator_name_and_reports_itself(assert_tree_close):
    x = f32([0.1, 0.2])
    prepared = ad.prepare("gradient", lambda x: jnp.sum(x**3), Active(x), backend=ad.AutoJAX())
    assert isinstance(prepared, ad.Prepared)
    assert "gradient" in repr(prepared) and "AutoJAX" in repr(prepared)
    assert_tree_close(prepared(f32([1.0, 2.0])), np.array([3.0, 12.0]), **JAX_TOL)


def test_prepared_backend_is_inferred_from_arguments(assert_tree_close):
    prepared = ad.prepare(ad.hessian, lambda x: jnp.sum(x**3), Active(f32([1.0, 2.0])))
    assert prepared.backend == ad.AutoJAX()
    assert_tree_close(prepared(f32([3.0, -1.0])), np.diag([18.0, -6.0]), **JAX_TOL, framework="jax")


def test_prepared_results_do_not_alias_between_calls(assert_tree_close):
    """A second call must not overwrite the arrays returned by the first (finite differences, numpy)."""
    prepared = ad.prepare(ad.gradient, lambda x: np.sum(x**2), Active(np.ones(3)), backend=ad.AutoFiniteDifferences())
    first = prepared(np.array([1.0, 2.0, 3.0]))
    snapshot = np.array(first)
    prepared(np.array([-5.0, 7.0, 0.5]))
    assert_tree_close(first, 2 * np.array([1.0, 2.0, 3.0]), **FD_TOL)
    np.testing.assert_array_equal(first, snapshot)


# ---------------------------------------------------------------- nesting inside JAX transforms


def _inner(w, c):
    return jnp.sum(jnp.sin(w * c))


@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
def test_gradient_inside_outer_grad_over_a_constant(prepared, assert_tree_close):
    """d/dc sum_i d/dw_i sum(sin(w*c)) = cos(w c) - w c sin(w c), with c an outer tracer."""
    rng = np.random.default_rng(7)
    w0, c0 = f32(rng.normal(size=3)), f32(rng.normal(size=3))
    if prepared:
        prep = ad.prepare(ad.gradient, _inner, Active(w0), Constant(f32(rng.normal(size=3))))
        inner_grad = lambda c: prep(w0, c)  # noqa: E731
    else:
        inner_grad = lambda c: ad.gradient(_inner, Active(w0), Constant(c), backend=ad.AutoJAX())  # noqa: E731

    outer = jax.grad(lambda c: jnp.sum(inner_grad(c)))(c0)
    w, c = np64(w0), np64(c0)
    assert_tree_close(outer, np.cos(w * c) - w * c * np.sin(w * c), **JAX_TOL, framework="jax")


def test_gradient_inside_outer_jacfwd_over_the_active_is_the_hessian(assert_tree_close):
    rng = np.random.default_rng(8)
    w0, c0 = f32(rng.normal(size=3)), f32(rng.normal(size=3))
    hess = jax.jacfwd(lambda w: ad.gradient(_inner, Active(w), Constant(c0)))(w0)
    w, c = np64(w0), np64(c0)
    assert_tree_close(hess, np.diag(-(c**2) * np.sin(w * c)), **JAX_TOL)


def test_gradient_inside_jit_and_vmap_over_constants(assert_tree_close):
    rng = np.random.default_rng(9)
    w0 = f32(rng.normal(size=3))
    cs = f32(rng.normal(size=(4, 3)))
    batched = jax.jit(jax.vmap(lambda c: ad.gradient(_inner, Active(w0), Constant(c))))(cs)
    w, c = np64(w0), np64(cs)
    assert_tree_close(batched, c * np.cos(w * c), **JAX_TOL, framework="jax")
    # The same through a raw jax.grad written out here.
    raw = jax.vmap(lambda c: jax.grad(_inner)(w0, c))(cs)
    assert_tree_close(batched, np.asarray(raw), **JAX_TOL)


def test_prepared_inside_outer_grad_does_not_leak_tracers(assert_tree_close):
    """After use under jax.grad, the prepared operator still works on concrete values."""
    rng = np.random.default_rng(10)
    w0, c0 = f32(rng.normal(size=3)), f32(rng.normal(size=3))
    prep = ad.prepare(ad.value_and_gradient, _inner, Active(w0), Constant(c0))
    jax.grad(lambda c: prep(w0, c)[0])(c0)
    value, grad = prep(w0, c0)
    w, c = np64(w0), np64(c0)
    assert_tree_close((value, grad), (np.sum(np.sin(w * c)), c * np.cos(w * c)), **JAX_TOL, framework="jax")


@pytest.mark.parametrize("backend", ["AutoJAX", "AutoFiniteDifferences"])
def test_non_strict_new_active_shape_with_a_per_call_tangent(backend, assert_tree_close):
    """strict=False re-prepares for a new Active shape; the tangent of that call has the new shape."""
    to, tol = (f32, JAX_TOL) if backend == "AutoJAX" else (np64, FD_TOL)
    xp = jnp if backend == "AutoJAX" else np
    rng = np.random.default_rng(11)
    b = getattr(ad, backend)()
    push = ad.prepare(ad.pushforward, lambda x: xp.sin(x), Active(to(rng.normal(size=3))),
                      tangent=to(rng.normal(size=3)), backend=b, strict=False)
    hvp = ad.prepare(ad.hvp, lambda x: xp.sum(xp.sin(x)), Active(to(rng.normal(size=3))),
                     tangent=to(rng.normal(size=3)), backend=b, strict=False)
    x, t = to(rng.normal(size=5)), to(rng.normal(size=5))
    assert_tree_close(push(x, tangent=t), np.cos(np64(x)) * np64(t), **tol)
    assert_tree_close(hvp(x, tangent=t), -np.sin(np64(x)) * np64(t), **tol)


def test_non_strict_kind_change_with_a_per_call_tangent(assert_tree_close):
    """Active(x), Active(y) re-prepared as Active(x), Constant(y): the tangent is then x's alone."""
    rng = np.random.default_rng(12)
    x, y = f32(rng.normal(size=2)), f32(rng.normal(size=2))
    f = lambda x, y: jnp.sum(x * x * y)  # noqa: E731
    prepared = ad.prepare(ad.hvp, f, Active(x), Active(y), tangent=(x, y), strict=False)
    t = f32(rng.normal(size=2))
    assert_tree_close(prepared(Active(x), Constant(y), tangent=t), 2 * np64(y) * np64(t), **JAX_TOL)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
@pytest.mark.parametrize("backend", ["AutoJAX", "AutoFiniteDifferences"])
def test_python_float_actives_and_tangents_when_prepared(backend, strict, assert_tree_close):
    b = getattr(ad, backend)()
    tol = JAX_TOL if backend == "AutoJAX" else FD_TOL
    push = ad.prepare(ad.pushforward, lambda t: t**3, Active(2.0), tangent=1.0, backend=b, strict=strict)
    assert_tree_close(push(3.0, tangent=0.5), np.asarray(3 * 9.0 * 0.5), **tol)
    pull = ad.prepare(ad.pullback, lambda a, b: a * a * b, Active(2.0), Active(1.0), cotangent=1.0, backend=b,
                      strict=strict)
    assert_tree_close(pull(3.0, 0.5, cotangent=2.0), (np.asarray(2 * 2 * 3.0 * 0.5), np.asarray(2 * 9.0)), **tol)

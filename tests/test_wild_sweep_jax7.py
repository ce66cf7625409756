"""AutoJAX on derivatives with respect to inputs and implicit ones (round 7): saliency of NNX,
Linen and Equinox models passed as Constants (BatchNorm in train mode, Dropout with rngs, Linen
``mutable=["batch_stats"]`` as aux), batched tangents along input directions; implicit and
adjoint differentiation (``lax.custom_root``, ``lax.custom_linear_solve``, ``odeint``, ``cg``);
a ``jax.custom_vjp`` function under the forward-mode operators; ``jax.debug.callback`` inside f;
attention masks, pooling, FFTs, ``jax.scipy.special`` and optax losses.

Every expected value comes from ``jax.grad`` / ``jax.jvp`` / ``nnx.grad`` / ``eqx.filter_grad``
written by hand, never from ``activity``.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental.ode import odeint

import activity as ad
from activity import Active, Constant

from _sweeps import assert_same_state, assert_trees, nnx_snapshot, normal


# ------------------------------------------------------------ saliency of models held constant


def test_saliency_of_an_nnx_model_in_train_mode_as_constant_leaves_its_batch_stats_and_rng_counts():
    """BatchNorm in train mode writes its running statistics and Dropout draws from its rngs:
    as a Constant the user's module keeps both (each call sees the same stats and the same
    mask), and the input gradient is ``nnx.grad``'s on a clone of the module."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 4, rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.bn(self.lin(x)))

    def loss(m, x):
        return jnp.sum(jnp.tanh(m(x)) ** 2)

    model = Net(nnx.Rngs(0, dropout=1))
    before = nnx_snapshot(model)
    x, x2 = normal(1, 5, 3), normal(2, 5, 3)

    def expected(x):
        return nnx.grad(loss, argnums=1)(nnx.clone(model), x)

    got = ad.gradient(loss, Constant(model), Active(x))
    assert_trees(got, expected(x))
    prepared = ad.prepare(ad.gradient, loss, Constant(model), Active(x))
    assert_trees(prepared(model, x2), expected(x2))
    assert_trees(prepared(Constant(model), Active(x)), expected(x))
    assert_same_state(before, nnx_snapshot(model))


def test_saliency_of_a_linen_model_with_its_new_batch_stats_as_aux():
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            x = nn.BatchNorm(use_running_average=not train)(nn.Dense(4)(x))
            return jnp.tanh(x)

    net = Net()
    x, x2 = normal(0, 5, 3), normal(1, 5, 3)
    variables = net.init(jax.random.key(1), x, False)
    frozen = jax.tree_util.tree_map(np.asarray, variables)

    def loss(x, variables):
        out, updates = net.apply(variables, x, True, mutable=["batch_stats"])
        return jnp.sum(out**2), updates

    got, updates = ad.gradient(loss, Active(x), Constant(variables), has_aux=True)
    want, want_updates = jax.grad(loss, has_aux=True)(x, variables)
    assert_trees(got, want)
    assert_trees(updates, want_updates)
    prepared = ad.prepare(ad.value_and_gradient, loss, Active(x), Constant(variables), has_aux=True)
    stepped = {"params": variables["params"], "batch_stats": updates["batch_stats"]}
    for data in (x2, x):
        assert_trees(prepared(data, stepped), jax.value_and_grad(loss, has_aux=True)(data, stepped))
    assert_trees(jax.tree_util.tree_map(np.asarray, variables), frozen)


def test_integrated_gradients_of_an_equinox_mlp_with_batched_tangents_and_a_path_of_gradients():
    """Saliency ``d out / d x``, its columns as a batch of tangents, and integrated gradients
    (the mean gradient along a straight path from a baseline) as a prepared gradient called at
    each point of the path."""
    mlp = eqx.nn.MLP(3, 1, 8, 2, key=jax.random.key(3))

    def out(model, x):
        return model(x)[0]

    x, baseline = normal(4, 3), jnp.zeros(3)
    saliency = eqx.filter_jit(eqx.filter_grad(lambda x, m: out(m, x)))(x, mlp)
    assert_trees(ad.gradient(out, Constant(mlp), Active(x)), saliency)
    directions = [jnp.eye(3)[i] for i in range(3)]
    got = ad.pushforward(out, Constant(mlp), Active(x), tangents=directions)
    assert_trees(got, list(saliency))  # out is a scalar: along e_i its derivative is the i-th saliency

    prepared = ad.prepare(ad.gradient, out, Constant(mlp), Active(baseline))
    alphas = jnp.linspace(0.0, 1.0, 4)
    path = [baseline + a * (x - baseline) for a in alphas]
    got_ig = (x - baseline) * sum(prepared(mlp, p) for p in path) / len(path)
    want_ig = (x - baseline) * jnp.mean(jax.jit(jax.vmap(jax.grad(lambda p: out(mlp, p))))(jnp.stack(path)), axis=0)
    assert_trees(got_ig, want_ig)


# ------------------------------------------------------------ implicit and adjoint derivatives


def newton_sqrt(theta, y0):
    """``sqrt(theta)`` by Newton's method, differentiated implicitly by `lax.custom_root`."""

    def solve(g, y):
        for _ in range(8):  # quadratic convergence from 1.0: enough for float32
            y = y - g(y) / (2 * y)
        return y

    return jax.lax.custom_root(lambda y: y**2 - theta, y0, solve, lambda g, y: y / jax.grad(g)(1.0))


def test_custom_root_gradient_and_hessian_and_custom_linear_solve_gradient_against_jax():
    def roots(theta, y0):
        return jnp.sum(jax.vmap(newton_sqrt, (0, None))(theta, y0) ** 3)

    theta, y0 = jnp.array([2.0, 3.0, 5.0]), jnp.array(1.0)
    assert_trees(ad.gradient(roots, Active(theta), Constant(y0)), 1.5 * jnp.sqrt(theta), rtol=1e-5, atol=1e-6)
    # Second order, prepared (eager, the Newton loop traces op by op twice over: seconds).
    prepared = ad.prepare(ad.hessian, roots, Active(theta), Constant(y0))
    for t in (theta + 1, theta + 2):
        assert_trees(prepared(t, y0), jnp.diag(0.75 / jnp.sqrt(t)), rtol=1e-5, atol=1e-6)

    def solved(A, b):
        x = jax.lax.custom_linear_solve(
            lambda v: A @ v, b, solve=lambda _, b: jnp.linalg.solve(A, b),
            transpose_solve=lambda _, b: jnp.linalg.solve(A.T, b),
        )
        return jnp.sum(jnp.sin(x))

    A, b = 3 * jnp.eye(3) + 0.1 * normal(0, 3, 3), jnp.arange(3.0)
    assert_trees(ad.gradient(solved, Active(A), Active(b)), jax.grad(solved, (0, 1))(A, b))


def test_odeint_adjoint_and_cg_inside_f_prepared_on_new_data():
    def final_energy(params, y0, t):
        ys = odeint(lambda y, t, p: -p["k"] * y + p["w"] @ jnp.tanh(y), y0, t, params, rtol=1e-6, atol=1e-6)
        return jnp.sum(ys[-1] ** 2)

    params = {"k": jnp.array(0.5), "w": 0.3 * normal(2, 2, 2)}
    y0, t = jnp.array([1.0, -0.5]), jnp.linspace(0.0, 1.0, 3)
    # Each program through odeint's adjoint compiles for a second or more: the prepared call
    # only (the unprepared operator is checked on the cg below).
    reference = jax.jit(jax.grad(final_energy))
    prepared = ad.prepare(ad.gradient, final_energy, Active(params), Constant(y0), Constant(t))
    for data in ((y0, t), (3 * y0, 2 * t)):
        assert_trees(prepared(params, *data), reference(params, *data))

    def cg_energy(A, b):
        x, _ = jax.scipy.sparse.linalg.cg(A @ A.T + jnp.eye(3), b, tol=1e-10, maxiter=50)
        return jnp.sum(x**2)

    A, b = normal(3, 3, 3), jnp.arange(3.0)
    reference = jax.jit(jax.grad(cg_energy, (0, 1)))  # cg's while_loop traces anew on each eager call
    got = jax.jit(lambda A, b: ad.gradient(cg_energy, Active(A), Active(b)))(A, b)
    assert_trees(got, reference(A, b))
    prepared = ad.prepare(ad.gradient, cg_energy, Active(A), Active(b))
    for data in ((A, b + 1), (2 * A, b)):
        assert_trees(prepared(*data), reference(*data))


def test_a_custom_vjp_function_under_forward_mode_operators_names_the_reverse_mode_ways():
    """JAX refuses forward mode through a ``jax.custom_vjp`` (odeint's adjoint): jacobian of an
    f with more outputs than inputs (the refusal inside `AutoJAX.jvp`) and a prepared hvp (JAX
    refuses under jit, after it) say which operators and which backend differentiate it, and those give what JAX's
    reverse mode gives."""

    def energy_ode(k, y0, t):
        return jnp.sum(odeint(lambda y, t, k: -k * y, y0, t, k) ** 2)

    @jax.custom_vjp
    def wave(x):
        return jnp.sin(x)

    wave.defvjp(lambda x: (jnp.sin(x), x), lambda x, ct: (ct * jnp.cos(x),))

    def energy(k):
        return jnp.sum(wave(k) ** 3)

    def spread(s):
        return wave(s * jnp.arange(1.0, 5.0))

    k, v = jnp.array([0.5, 1.0, 2.0, 3.0]), jnp.arange(4.0)
    y0, t = Constant(jnp.ones(4)), Constant(jnp.linspace(0.0, 1.0, 2))
    calls = [
        lambda: ad.prepare(ad.hvp, energy_ode, Active(k), y0, t, tangent=v)(k, y0.value, t.value, tangent=v),
        lambda: ad.jacobian(spread, Active(jnp.array(0.5))),
    ]
    for call in calls:
        with pytest.raises(TypeError, match="custom_vjp") as caught:
            call()
        assert any('mode="reverse-over-reverse"' in note for note in caught.value.__notes__)

    reverse = ad.SecondOrder(ad.AutoJAX(), ad.AutoJAX(), mode="reverse-over-reverse")
    want = jax.grad(lambda k: jnp.vdot(jax.grad(energy)(k), v))(k)
    assert_trees(ad.hvp(energy, Active(k), tangent=v, backend=reverse), want)
    assert_trees(ad.hvp(energy, Active(k), tangent=v), want)  # JAX takes forward over this reverse rule
    rows = ad.pullback(spread, Active(jnp.array(0.5)), cotangents=list(jnp.eye(4)))
    assert_trees(jnp.stack(rows), jax.jacrev(spread)(jnp.array(0.5)))


# ------------------------------------------------------------ side effects and functions


def control_flow(p, x, i):
    h = jax.lax.cond(jnp.sum(x) > 0, jnp.sin, jnp.cos, p["w"] * x)
    h = jax.lax.switch(i, [lambda v: v**2, jnp.exp, lambda v: v], h)
    h = jax.lax.associative_scan(jnp.add, h) + jax.lax.map(lambda r: r * p["b"], h)
    h = jnp.vectorize(lambda a, b: a * jnp.tanh(b), signature="(),()->()")(h, p["b"])
    h = h + jax.vmap(lambda t, s: t["u"] * s, in_axes=({"u": 0}, None))({"u": h}, p["b"][0])
    with jax.ensure_compile_time_eval():
        c = jnp.arange(3.0) + 1
    return jnp.sum(h * c + jax.lax.stop_gradient(p["w"]) * h)


def test_cond_switch_on_data_scans_vectorize_pytree_in_axes_and_stop_gradient_inside_f():
    """Branches chosen by the data change between prepared calls; ``stop_gradient`` is honoured
    as ``jax.grad`` honours it. The unprepared call runs under the user's ``jax.jit`` (eager,
    each ``lax.map`` and ``cond`` traces anew: seconds)."""
    p = {"w": jnp.array([0.3, -0.2, 0.5]), "b": jnp.array([1.0, 2.0, 0.5])}
    x, i = jnp.array([1.0, 2.0, -0.5]), jnp.array(1)
    reference = jax.jit(jax.grad(control_flow, (0, 1)))
    got = jax.jit(lambda p, x, i: ad.gradient(control_flow, Active(p), Active(x), Constant(i)))(p, x, i)
    assert_trees(got, reference(p, x, i))
    prepared = ad.prepare(ad.gradient, control_flow, Active(p), Constant(x), Constant(i))
    for data in ((-x, jnp.array(0)), (2 * x, jnp.array(2))):
        assert_trees(prepared(p, *data), reference(p, *data)[0], rtol=1e-5, atol=1e-5)


def test_a_debug_callback_inside_f_runs_once_per_call_as_in_jax_grad_and_not_at_prepare():
    seen = []

    def f(w, x):
        jax.debug.callback(lambda s: seen.append(float(s)), jnp.sum(w))
        return jnp.sum(jnp.sin(w * x))

    w, x = jnp.arange(3.0), jnp.ones(3)
    jax.grad(f)(w, x)
    jax.effects_barrier()
    assert len(seen) == 1
    for op, kw in [(ad.gradient, {}), (ad.hvp, {"tangent": jnp.ones(3)}), (ad.jacobian, {})]:
        seen.clear()
        op(f, Active(w), Constant(x), **kw)
        prepared = ad.prepare(op, f, Active(w), Constant(x), **kw)
        jax.effects_barrier()
        assert len(seen) == 1, op
        prepared(w + 1, x, **kw)
        jax.effects_barrier()
        assert seen == [3.0, 6.0], op


def test_attention_masks_pooling_fft_special_functions_and_optax_losses_gradient_and_hvp():
    """The unprepared gradient runs under the user's own ``jax.jit`` (op by op it compiles every
    primitive of the model and its derivatives one at a time: seconds)."""

    def model(p, x, mask, labels):
        q = k = v = jnp.tanh(x @ p["w"]).reshape(1, 4, 1, 2)  # batch, length, heads, features
        att = jax.nn.dot_product_attention(q, k, v, mask=mask)[0, :, 0]
        pooled = jax.lax.reduce_window(att, -jnp.inf, jax.lax.max, (2, 1), (2, 1), "VALID")
        spectrum = jnp.fft.irfft(jnp.fft.rfft(att, axis=0) * jnp.array([1.0, 0.5, 0.25])[:, None], n=4, axis=0)
        logits = jnp.concatenate([pooled, (p["a"] @ spectrum.T).T[:2]], axis=1)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        huber = optax.huber_loss(logits, delta=0.5).mean()
        return ce + huber + jnp.sum(jax.scipy.special.xlogy(jax.nn.softplus(logits), 1 + logits**2))

    p = {"w": normal(0, 3, 2), "a": normal(1, 2, 2)}
    x, mask, labels = normal(2, 4, 3), jnp.tril(jnp.ones((1, 1, 4, 4), bool)), jnp.array([1, 3])
    other = (2 * x, jnp.ones((1, 1, 4, 4), bool), jnp.array([0, 2]))
    reference_grad = jax.jit(jax.grad(model, (0, 1)))
    got = jax.jit(lambda p, x: ad.gradient(model, Active(p), Active(x), Constant(mask), Constant(labels)))(p, x)
    assert_trees(got, reference_grad(p, x, mask, labels))

    tangent = {"w": normal(3, 3, 2), "a": normal(4, 2, 2)}
    reference_hvp = jax.jit(lambda p, x, mask, labels: jax.jvp(lambda p: jax.grad(model)(p, x, mask, labels), (p,), (tangent,))[1])
    prepared = ad.prepare(ad.hvp, model, Active(p), Constant(x), Constant(mask), Constant(labels), tangent=tangent)
    for data in ((x, mask, labels), other):
        assert_trees(prepared(p, *data, tangent=tangent), reference_hvp(p, *data), rtol=1e-4, atol=1e-5)

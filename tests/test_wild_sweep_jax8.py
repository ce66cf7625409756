"""AutoJAX on the libraries users bring (round 8): diffrax ``diffeqsolve`` of an Equinox vector
field under its adjoints, optimistix root finding, minimisation and least squares with their
implicit adjoint, lineax solves of an Active matrix, Equinox ``Shared`` tied weights,
``filter_checkpoint``, ``tree_at`` and ``inference_mode`` inside f, attention with a mask, Flax
NNX ``scan`` / ``remat`` / ``vmap`` / ``split_rngs`` / ``Rngs.fork`` inside f, and a Linen
``nn.vmap`` ensemble.

Every expected value comes from ``jax.grad`` / ``jax.jvp`` / ``eqx.filter_grad`` / ``nnx.grad``
written by hand, or a closed form, never from ``activity``.
"""

from __future__ import annotations

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import optimistix as optx
import pytest

import activity as ad
from activity import Active, Constant
from activity.testing import check

from _sweeps import assert_same_state, assert_trees, nnx_snapshot, normal


def hvp_of(loss, dynamic, static, tangent, *rest):
    """``jax.jvp`` of ``jax.grad`` of ``loss`` in the inexact arrays of an Equinox model."""
    return jax.jvp(jax.grad(lambda d: loss(eqx.combine(d, static), *rest)), (dynamic,), (tangent,))[1]


# ------------------------------------------------------------ diffrax


class Field(eqx.Module):
    w: jax.Array
    b: jax.Array

    def __call__(self, t, y, k):
        return jnp.tanh(self.w @ y + self.b) - k * y


def energy(field, y0, k):
    # Fixed Heun steps: an adaptive Tsit5 / Kvaerno5 with a PIDController compiles for seconds
    # (both checked the same way outside the suite).
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(field), diffrax.Heun(), 0.0, 1.0, 0.1, y0, args=k, saveat=diffrax.SaveAt(ts=jnp.array([0.5, 1.0]))
    )
    return jnp.sum(sol.ys**2)


def test_diffrax_default_adjoint_prepared_on_new_initial_conditions_and_its_second_order_refusal():
    """The default adjoint (RecursiveCheckpointAdjoint) prepared and called on two new initial
    conditions against ``eqx.filter_grad``; an hvp through it is JAX's refusal of forward mode,
    and, as reverse over reverse fails there too (see the next test), its note names the adjoints that go forward
    (DirectAdjoint's hvp and ForwardMode's pushforward were checked against ``jax.jvp`` outside
    the suite: seconds of compiling each)."""
    field = Field(0.5 * normal(0, 2, 2), 0.1 * normal(1, 2))
    y0, k = jnp.array([1.0, -0.5]), jnp.array(0.3)
    reference = eqx.filter_jit(eqx.filter_grad(energy))
    prepared = ad.prepare(ad.gradient, energy, Active(field), Constant(y0), Constant(k))
    for data in ((2 * y0, k), (-y0, k + 1)):
        assert_trees(prepared(field, *data), reference(field, *data))

    tangent = Field(jnp.ones((2, 2)), jnp.ones(2))
    with pytest.raises(TypeError, match="custom_vjp") as caught:
        ad.hvp(energy, Active(field), Constant(y0), Constant(k), tangent=tangent)
    assert any("adjoint=diffrax.DirectAdjoint()" in note for note in caught.value.__notes__)


@jax.custom_vjp
def damped(x):
    return jnp.sin(x)


def _damped_backward(x, ct):
    # A loop of unknown length in the backward pass, as in diffrax's adjoints (a reverse-over-
    # reverse of the diffrax solve above meets it the same way, in seconds of tracing).
    def step(carry):
        return carry[0] + 1, 0.9 * carry[1]

    return (ct * jax.lax.while_loop(lambda carry: carry[0] < 3, step, (0, jnp.cos(x)))[1],)


damped.defvjp(lambda x: (jnp.sin(x), x), _damped_backward)


def test_reverse_over_reverse_through_a_loop_in_a_backward_pass_and_check_keep_the_advice():
    """The way the forward-mode note names for a custom_vjp, reverse over reverse, meets the
    loop of its backward pass: that error has a note of its own, naming the adjoint again; and
    the testing kit's report line keeps the forward-mode note (JAX's message alone does not say
    what to do)."""

    def energy(x):
        return jnp.sum(damped(x) ** 2)

    x = jnp.array([0.5, 1.0])
    reverse = ad.SecondOrder(ad.AutoJAX(), ad.AutoJAX(), mode="reverse-over-reverse")
    with pytest.raises(ValueError, match="while_loop") as caught:
        ad.hvp(energy, Active(x), tangent=jnp.ones(2), backend=reverse)
    assert any("f's gradient in reverse mode" in note and "DirectAdjoint()" in note for note in caught.value.__notes__)
    with pytest.raises(AssertionError, match=r"pushforward\[u0\].*reverse-over-reverse"):
        check(energy, Active(x), operators=["pushforward"], directions=1)


# ------------------------------------------------------------ optimistix and lineax


def cubic_root(p, y0):
    sol = optx.root_find(lambda y, p: y**3 + p["a"] * y - p["b"], optx.Newton(rtol=1e-7, atol=1e-7), y0, args=p)
    return jnp.sum(sol.value**2), sol


def test_optimistix_root_find_prepared_with_its_solution_as_aux_against_the_implicit_closed_form():
    p, y0 = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([0.5, 3.0])}, jnp.ones(2)
    reference = eqx.filter_jit(jax.grad(cubic_root, has_aux=True))
    prepared = ad.prepare(ad.gradient, cubic_root, Active(p), Constant(y0), has_aux=True)
    for q in ({"a": p["a"] + 1, "b": p["b"]}, p):
        got, sol = prepared(q, 2 * y0)
        want, want_sol = reference(q, 2 * y0)
        assert_trees(got, want)
        assert sol.result == optx.RESULTS.successful
        # Implicitly, dy/db = 1 / (3 y^2 + a): the closed form the implicit adjoint must agree with.
        y = want_sol.value
        np.testing.assert_allclose(sol.value, y, rtol=1e-6)
        np.testing.assert_allclose(got["b"], 2 * y / (3 * y**2 + q["a"]), rtol=1e-5)


def test_optimistix_minimise_and_least_squares_against_closed_forms():
    """BFGS on a quadratic, whose minimiser is ``c``, and Levenberg-Marquardt on a linear residual,
    whose solution is the normal equations': the gradients of the closed forms with ``jax.grad``."""
    y0 = jnp.zeros(2)

    def minimised(p, y0):
        fn = lambda y, p: jnp.sum(p["s"] * (y - p["c"]) ** 2)  # noqa: E731
        return jnp.sum(jnp.sin(optx.minimise(fn, optx.BFGS(rtol=1e-8, atol=1e-8), y0, args=p).value))

    p = {"c": jnp.array([1.0, -2.0]), "s": jnp.array([1.0, 3.0])}
    want = {"c": jnp.cos(p["c"]), "s": jnp.zeros(2)}
    assert_trees(ad.gradient(minimised, Active(p), Constant(y0)), want, rtol=1e-4, atol=1e-5)

    def fitted(p, y0):
        fn = lambda y, p: p["A"] @ y - p["b"]  # noqa: E731
        return jnp.sum(optx.least_squares(fn, optx.LevenbergMarquardt(rtol=1e-8, atol=1e-8), y0, args=p).value ** 2)

    def normal_equations(p):
        return jnp.sum(jnp.linalg.solve(p["A"].T @ p["A"], p["A"].T @ p["b"]) ** 2)

    p = {"A": jnp.array([[2.0, 0.5], [0.1, 1.0], [0.3, 0.2]]), "b": jnp.array([1.0, 2.0, 0.5])}
    assert_trees(ad.gradient(fitted, Active(p), Constant(y0)), jax.grad(normal_equations)(p), rtol=1e-4, atol=1e-5)


def test_lineax_solve_of_an_active_matrix_and_a_singular_one_in_a_prepared_call():
    def solve(A, b):
        return jnp.sum(jnp.tanh(lx.linear_solve(lx.MatrixLinearOperator(A), b).value))

    A, b = 3 * jnp.eye(3) + 0.1 * normal(0, 3, 3), jnp.arange(3.0)
    assert_trees(ad.gradient(solve, Active(A), Active(b)), jax.grad(solve, (0, 1))(A, b))
    prepared = ad.prepare(ad.hvp, solve, Active(A), Constant(b), tangent=normal(1, 3, 3))
    for data in ((A + 1, b + 1), (2 * A, -b)):
        want = jax.jvp(jax.grad(lambda A: solve(A, data[1])), (data[0],), (jnp.eye(3),))[1]
        assert_trees(prepared(*data, tangent=jnp.eye(3)), want)

    # A singular matrix fails lineax's runtime check (equinox.error_if) inside the prepared call,
    # compiled by activity with jax.jit: Equinox's advice to use equinox.filter_jit does not apply.
    with pytest.raises(RuntimeError, match="nonsingular") as caught:
        prepared(jnp.zeros((3, 3)), b, tangent=jnp.eye(3))
    assert any("prepared) A runtime check inside f failed" in note for note in caught.value.__notes__)


# ------------------------------------------------------------ Equinox


class Tied(eqx.Module):
    """A language-model head sharing its weight with the embedding."""

    shared: eqx.nn.Shared

    def __init__(self, key):
        embedding = eqx.nn.Embedding(5, 3, key=key)
        head = eqx.nn.Linear(3, 5, use_bias=False, key=key)
        self.shared = eqx.nn.Shared((embedding, head), lambda s: s[1].weight, lambda s: s[0].weight)

    def __call__(self, token):
        embedding, head = self.shared()
        return head(jnp.tanh(embedding(token)))


def test_equinox_shared_tied_weights_gradient_hvp_and_prepared_like_filter_grad():
    model = Tied(jax.random.key(0))

    def loss(m, token):
        return jnp.sum(jax.nn.log_softmax(m(token)) ** 2)

    token = jnp.array(2)
    assert_trees(ad.gradient(loss, Active(model), Constant(token)), eqx.filter_grad(loss)(model, token))
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(token))
    for t in (jnp.array(4), jnp.array(0)):
        assert_trees(prepared(model, t), eqx.filter_grad(loss)(model, t))
    dynamic, static = eqx.partition(model, eqx.is_inexact_array)
    tangent = jax.tree_util.tree_map(jnp.ones_like, dynamic)
    assert_trees(ad.hvp(loss, Active(model), Constant(token), tangent=tangent), hvp_of(loss, dynamic, static, tangent, token))


def test_equinox_checkpoint_tree_at_inference_mode_and_masked_attention_inside_f():
    key = jax.random.key(0)

    class Net(eqx.Module):
        mlp: eqx.nn.MLP
        drop: eqx.nn.Dropout

        def __call__(self, x, key):
            return self.drop(eqx.filter_checkpoint(lambda m, x: m(x))(self.mlp, x), key=key)

    net = Net(eqx.nn.MLP(3, 2, 4, 2, key=key), eqx.nn.Dropout(0.5))

    def loss(m, x, scale, key):
        m = eqx.tree_at(lambda m: m.mlp.layers[0].bias, m, m.mlp.layers[0].bias * scale)
        return jnp.sum(m(x, key) ** 2)

    def evaluated(m, x, scale, key):
        return loss(eqx.nn.inference_mode(m), x, scale, key)

    x, scale, draw = jnp.arange(3.0), jnp.array(2.0), jax.random.key(1)
    assert_trees(ad.gradient(evaluated, Active(net), Constant(x), Constant(scale), Constant(draw)), eqx.filter_grad(evaluated)(net, x, scale, draw))

    attention = eqx.nn.MultiheadAttention(2, 4, key=key)

    def attended(m, q, mask):
        return jnp.sum(m(q, q, q, mask=mask) ** 2)

    q, causal = normal(3, 3, 4), jnp.tril(jnp.ones((3, 3), bool))
    prepared = ad.prepare(ad.gradient, attended, Active(attention), Constant(q), Constant(causal))
    reference = eqx.filter_jit(eqx.filter_grad(attended))
    for data in ((2 * q, jnp.ones((3, 3), bool).at[0, 1:].set(False)), (q, causal)):
        assert_trees(prepared(attention, *data), reference(attention, *data))


# ------------------------------------------------------------ Flax NNX and Linen lifted transforms


def test_nnx_scan_of_remat_layers_made_by_vmap_with_dropout_and_a_vmap_ensemble_hvp():
    """Layers stacked by ``nnx.split_rngs`` + ``nnx.vmap``, run by ``nnx.scan`` of ``nnx.remat``
    in train mode (their dropout draws move the stacked rng counts inside f), and the same layers
    as an ensemble under ``nnx.vmap``: ``nnx.grad`` on a clone, and the user's model (params, rng
    counts) as it was."""
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 3, rngs=rngs)
            self.drop = nnx.Dropout(0.3, rngs=rngs)

        def __call__(self, x):
            return self.drop(jnp.tanh(self.lin(x)))

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stacked(rngs):
        return Block(rngs)

    class Deep(nnx.Module):
        def __init__(self, rngs):
            self.blocks = stacked(rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def run(x, block):
                return nnx.remat(lambda b, x: b(x))(block, x)

            return run(x, self.blocks)

    def deep(m, x):
        return jnp.sum(m(x) ** 2)

    def ensemble(m, x):
        return jnp.sum(nnx.vmap(lambda b, x: b(x), in_axes=(0, None))(m.blocks, x) ** 2)

    model = Deep(nnx.Rngs(0, dropout=1))
    before = nnx_snapshot(model)
    x, x2 = normal(5, 2, 3), normal(6, 2, 3)
    prepared = ad.prepare(ad.gradient, deep, Active(model), Constant(x))
    reference = nnx.jit(nnx.grad(deep))
    for data in (x2, x2):  # the same data twice: the same mask, as the user's rng counts stay
        assert_trees(prepared(model, data), reference(nnx.clone(model), data))
    assert_same_state(before, nnx_snapshot(model))

    tangent = jax.tree_util.tree_map(jnp.ones_like, nnx.state(model, nnx.Param))
    graph, params, rest = nnx.split(nnx.clone(model), nnx.Param, ...)
    # A fresh copy of the rng counts per merge: the vmapped dropout writes them at its own trace level.
    rebuilt = lambda p: nnx.merge(graph, p, jax.tree_util.tree_map(lambda a: a, rest))  # noqa: E731
    want = jax.jit(lambda p, t: jax.jvp(jax.grad(lambda p: ensemble(rebuilt(p), x)), (p,), (t,))[1])(params, tangent)
    assert_trees(ad.hvp(ensemble, Active(model), Constant(x), tangent=tangent), want)
    assert_same_state(before, nnx_snapshot(model))


def test_nnx_stacked_batch_norm_split_rngs_noise_and_a_forked_rngs_constant():
    """Stacked BatchNorm layers in train mode scanned over, noise drawn under ``nnx.split_rngs``
    inside f, their new batch statistics returned as aux (``nnx.grad`` writes them into its
    clone; activity returns them and leaves the user's model as it was), and an ``nnx.Rngs``
    passed as a Constant that f forks."""
    from flax import nnx

    class Layer(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 3, rngs=rngs)
            self.bn = nnx.BatchNorm(3, rngs=rngs)

        def __call__(self, x):
            return jnp.tanh(self.bn(self.lin(x)))

    @nnx.vmap(in_axes=0, out_axes=0)
    def stacked(key):
        return Layer(nnx.Rngs(key))

    class Deep(nnx.Module):
        def __init__(self):
            self.layers = stacked(jax.random.split(jax.random.key(0), 3))
            self.rngs = nnx.Rngs(noise=4)

        def __call__(self, x):
            y = nnx.scan(lambda x, layer: layer(x), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.layers)

            @nnx.split_rngs(splits=2)
            @nnx.vmap(in_axes=(0, None))
            def noisy(rngs, y):
                return y + 0.1 * jax.random.normal(rngs.noise(), y.shape)

            return noisy(self.rngs, y)

    def loss(m, x, rngs):
        jitter = jax.random.normal(rngs.fork().jitter(), x.shape)
        return jnp.sum(m(x + 0.01 * jitter) ** 2), nnx.state(m, nnx.BatchStat)

    model, rngs = Deep(), nnx.Rngs(jitter=7)
    before, rngs_before = nnx_snapshot(model), nnx_snapshot(rngs)
    x = normal(5, 4, 3)
    prepared = ad.prepare(ad.value_and_gradient, loss, Active(model), Constant(x), Constant(rngs), has_aux=True)
    for data in (2 * x, -x):
        (value, stats), got = prepared(model, data, rngs)
        (want_value, want_stats), want = nnx.value_and_grad(loss, has_aux=True)(nnx.clone(model), data, nnx.clone(rngs))
        assert_trees((value, got, stats), (want_value, want, want_stats), rtol=1e-5, atol=1e-5)
    assert_same_state(before, nnx_snapshot(model))
    assert_same_state(rngs_before, nnx_snapshot(rngs))


def test_linen_vmap_ensemble_with_dropout_prepared_on_new_data_and_keys():
    import flax.linen as nn

    class Member(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            return nn.Dropout(0.4, deterministic=not train)(jnp.tanh(nn.Dense(2)(x)))

    class Ensemble(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            members = nn.vmap(
                Member, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                in_axes=None, axis_size=3,
            )
            return members()(x, train)

    net, x = Ensemble(), normal(1, 4, 3)
    params = net.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x, False)["params"]
    frozen = jax.tree_util.tree_map(np.asarray, params)

    def loss(params, x, key):
        return jnp.sum(net.apply({"params": params}, x, True, rngs={"dropout": key}) ** 2)

    reference = jax.jit(jax.grad(loss))
    key = jax.random.key(7)
    prepared = ad.prepare(ad.gradient, loss, Active(params), Constant(x), Constant(key))
    for data in ((2 * x, jax.random.key(8)), (x, key)):
        assert_trees(prepared(params, *data), reference(params, *data), rtol=1e-5, atol=1e-5)
    assert_trees(jax.tree_util.tree_map(np.asarray, params), frozen)

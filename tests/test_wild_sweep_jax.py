"""AutoJAX on third-party JAX models the other model tests do not cover: Flax NNX modules
inside a pytree, NNX stacked (vmap/scan) layers and a teacher as Constant, Equinox
``eqx.nn.Shared`` tied weights and a GRU cell over ``lax.scan``, Linen ``nn.scan``-ed and
``nn.RNN`` layers, a Haiku LSTM in an optax loop.

Every expected value comes from the model library's own differentiation (``nnx.grad``,
``eqx.filter_grad``, ``jax.grad`` / ``jax.jvp`` on an ``apply``) or from the finite-difference
reference, never from ``activity``; each test also checks that the user's model is unchanged.
"""

from __future__ import annotations

import warnings

import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen
from flax import nnx

import activity as ad
from activity import Active, Constant

from _sweeps import CLOSE, assert_trees, normal

FD_CLOSE = dict(rtol=2e-3, atol=2e-4)  # float32 models against float64 central differences


def snapshot(value):
    """Every array of ``value`` (NNX modules through ``nnx.split``) and the NNX graphs."""
    graphs, leaves = [], []

    def visit(node):
        if isinstance(node, nnx.Module):
            graphdef, state = nnx.split(node)
            graphs.append(graphdef)
            visit(state)
            return node
        for leaf in jax.tree_util.tree_leaves(node):
            if not eqx.is_array(leaf):  # functions, markers: kept by identity
                leaves.append(leaf)
                continue
            if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                leaf = jax.random.key_data(leaf)
            leaves.append(np.array(leaf))
        return node

    jax.tree_util.tree_map(visit, value, is_leaf=lambda node: isinstance(node, nnx.Module))
    return graphs, leaves


def assert_unchanged(value, before):
    graphs, leaves = snapshot(value)
    assert graphs == before[0], "an NNX graph changed"
    assert len(leaves) == len(before[1])
    for now, then in zip(leaves, before[1]):
        if isinstance(then, np.ndarray):
            np.testing.assert_array_equal(now, then)
        else:
            assert now is then


def vdot(a, b) -> jax.Array:
    return sum(jnp.vdot(x, y) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


# ------------------------------------------------- Flax NNX modules inside a pytree


class NormedNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 4, rngs=rngs)
        self.norm = nnx.BatchNorm(4, rngs=rngs)
        self.dropout = nnx.Dropout(0.3, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.norm(self.linear(x)))


def scaled_loss(tree, x):
    return jnp.sum(jnp.tanh(tree["model"](x)) ** 2) * tree["scale"] * tree["weight"]


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_an_nnx_module_inside_a_dict_is_differentiated_in_its_params_as_nnx_grad_does(mode):
    model = NormedNet(nnx.Rngs(params=0, dropout=1))
    getattr(model, mode)()
    model.norm.mean[...] = normal(2, 4)  # statistics that make eval mode depend on them
    tree = {"model": model, "scale": jnp.asarray(1.5), "weight": 0.5}
    before = snapshot(tree)

    def expected(x):
        grads = dict(nnx.grad(scaled_loss)(nnx.clone(tree), x))
        grads["weight"] = None  # a Python number inside a pytree is a hyper-parameter
        return grads

    x, new_x = normal(3, 5, 3), normal(4, 5, 3)
    result = ad.gradient(scaled_loss, Active(tree), Constant(x))
    assert type(result["model"]) is nnx.State and "mean" not in result["model"]["norm"]  # no BatchStat gradient
    assert_trees(result, expected(x))
    prepared = ad.prepare(ad.gradient, scaled_loss, Active(tree), Constant(x))
    assert_trees(prepared(tree, new_x), expected(new_x))
    if mode == "eval":  # in float64 (as the reference evaluates), jax.random draws another dropout mask
        reference = ad.gradient(scaled_loss, Active(tree), Constant(x), backend=ad.AutoFiniteDifferences())
        assert_trees(reference, expected(x), **FD_CLOSE)
    assert_unchanged(tree, before)  # BatchNorm statistics and the dropout RNG count included


def test_where_and_hvp_on_nnx_modules_inside_a_dict():
    model = NormedNet(nnx.Rngs(5))
    model.eval()
    tree = {"model": model, "scale": jnp.asarray(1.5), "weight": 0.5}
    x = normal(6, 5, 3)
    seen = []
    masked = ad.gradient(scaled_loss, Active(tree, where=lambda path, leaf: seen.append(path) or "linear" in path), Constant(x))
    assert "['model']['linear']['kernel']" in seen and "['scale']" in seen, seen
    full = nnx.grad(scaled_loss)(nnx.clone(tree), x)
    assert_trees(masked["model"]["linear"], full["model"]["linear"])
    assert masked["scale"] is None and jax.tree_util.tree_leaves(masked["model"]["norm"]) == []

    gradient = ad.gradient(scaled_loss, Active(tree), Constant(x))
    tangent = jax.tree_util.tree_map(lambda leaf: jnp.full_like(leaf, 0.5), gradient)
    directional = {"model": tangent["model"], "scale": tangent["scale"]}

    def along_tangent(tree):
        grads = nnx.grad(scaled_loss)(tree, x)
        return vdot({"model": grads["model"], "scale": grads["scale"]}, directional)

    np.testing.assert_allclose(ad.pushforward(scaled_loss, Active(tree), Constant(x), tangent=tangent), along_tangent(nnx.clone(tree)), **CLOSE)
    expected = dict(nnx.grad(along_tangent)(nnx.clone(tree)))
    expected["weight"] = None
    assert_trees(ad.hvp(scaled_loss, Active(tree), Constant(x), tangent=tangent), expected)


class TiedHalf(nnx.Module):
    def __init__(self, embed: nnx.Embed, rngs: nnx.Rngs):
        self.embed = embed
        self.hidden = nnx.Linear(3, 3, rngs=rngs)

    def __call__(self, ids):
        return self.embed.attend(jnp.tanh(self.hidden(self.embed(ids))))


def pair_loss(pair, ids):
    return jnp.sum(pair[0](ids) * pair[1](ids))


def test_a_variable_shared_by_two_nnx_modules_in_a_list_is_one_parameter():
    embed = nnx.Embed(5, 3, rngs=nnx.Rngs(7))
    pair = [TiedHalf(embed, nnx.Rngs(8)), TiedHalf(embed, nnx.Rngs(9))]
    before = snapshot(pair)
    ids, new_ids = jnp.array([0, 2, 4]), jnp.array([1, 1, 3])
    result = ad.gradient(pair_loss, Active(pair), Constant(ids))
    expected = nnx.grad(pair_loss)(nnx.clone(pair), ids)
    assert "embed" in result[0] and "embed" not in result[1]  # under its first module, as nnx.grad lists it
    assert_trees(result, expected)  # the sum over both modules' uses, not each one's part
    prepared = ad.prepare(ad.gradient, pair_loss, Active(pair), Constant(ids))
    assert_trees(prepared(pair, new_ids), nnx.grad(pair_loss)(nnx.clone(pair), new_ids))
    assert_unchanged(pair, before)


def test_an_nnx_teacher_as_constant_and_stacked_layers_made_by_vmap_and_scan():
    class Layer(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(4, 4, rngs=rngs)
            self.norm = nnx.LayerNorm(4, rngs=rngs)

        def __call__(self, x):
            return self.norm(jnp.tanh(self.linear(x))) + x

    class Stack(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=3)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return Layer(rngs)

            self.layers = make(rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def body(x, layer):
                return layer(x)

            return body(x, self.layers)

    student, teacher = Stack(nnx.Rngs(10)), NormedNet(nnx.Rngs(params=11, dropout=12))  # the teacher trains

    before = snapshot((student, teacher))
    x, new_x = normal(13, 5, 4), normal(14, 5, 4)

    def teacher_loss(student, teacher, x):
        return jnp.mean((student(x) - teacher(x[:, :3])) ** 2)

    expected = lambda x: nnx.grad(teacher_loss)(nnx.clone(student), nnx.clone(teacher), x)
    assert_trees(ad.gradient(teacher_loss, Active(student), Constant(teacher), Constant(x)), expected(x))
    prepared = ad.prepare(ad.gradient, teacher_loss, Active(student), Constant(teacher), Constant(x))
    assert_trees(prepared(student, teacher, new_x), expected(new_x))
    assert_unchanged((student, teacher), before)  # the teacher's statistics and RNG count too


# -------------------------------------------------------------------------- Equinox


class TiedLanguageModel(eqx.Module):
    shared: eqx.nn.Shared

    def __init__(self, key):
        embed_key, linear_key = jax.random.split(key)
        embedding = eqx.nn.Embedding(6, 3, key=embed_key)
        linear = eqx.nn.Linear(3, 6, use_bias=False, key=linear_key)
        self.shared = eqx.nn.Shared((embedding, linear), lambda pair: pair[1].weight, lambda pair: pair[0].weight)

    def __call__(self, token):
        embedding, linear = self.shared()
        return linear(jnp.tanh(embedding(token)))


def tied_loss(model, tokens):
    logits = jax.vmap(model)(tokens)
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(tokens.shape[0]), tokens])


def test_equinox_shared_tied_weights_prepare_without_a_false_alarm():
    model = TiedLanguageModel(jax.random.key(15))
    tokens, new_tokens = jnp.array([0, 3, 5]), jnp.array([1, 1, 2])
    before = snapshot(model)
    assert_trees(ad.gradient(tied_loss, Active(model), Constant(tokens)), eqx.filter_grad(tied_loss)(model, tokens))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the SharedNode marker left in place of the tied weight holds nothing
        prepared = ad.prepare(ad.gradient, tied_loss, Active(model), Constant(tokens))
    assert_trees(prepared(model, new_tokens), eqx.filter_grad(tied_loss)(model, new_tokens))
    assert_unchanged(model, before)


def test_equinox_gru_cell_over_lax_scan_every_first_and_second_order_operator():
    cell = eqx.nn.GRUCell(3, 4, key=jax.random.key(16))

    def loss(cell, xs):
        final, hidden = jax.lax.scan(lambda h, x: (cell(x, h), cell(x, h)), jnp.zeros(4), xs)
        return jnp.sum(hidden**2) + jnp.sum(final)

    xs, new_xs = normal(17, 3, 3), normal(18, 3, 3)
    params, static = eqx.partition(cell, eqx.is_inexact_array)
    tangent = jax.tree_util.tree_map(lambda leaf: jnp.full_like(leaf, 0.1), params)
    on_params = lambda params, xs: loss(eqx.combine(params, static), xs)
    assert_trees(ad.gradient(loss, Active(cell), Constant(xs)), eqx.filter_grad(loss)(cell, xs))
    prepared = ad.prepare(ad.gradient, loss, Active(cell), Constant(xs))
    assert_trees(prepared(cell, new_xs), eqx.filter_grad(loss)(cell, new_xs))
    np.testing.assert_allclose(
        ad.pushforward(loss, Active(cell), Constant(xs), tangent=tangent),
        jax.jvp(lambda p: on_params(p, xs), (params,), (tangent,))[1], **CLOSE,
    )
    expected_hvp = jax.jvp(jax.grad(lambda p: on_params(p, xs)), (params,), (tangent,))[1]
    assert_trees(ad.hvp(loss, Active(cell), Constant(xs), tangent=tangent), expected_hvp, rtol=1e-4, atol=1e-5)


def test_equinox_dropout_switched_to_inference_after_prepare():
    class Net(eqx.Module):
        linear: eqx.nn.Linear
        dropout: eqx.nn.Dropout

        def __call__(self, x, key):
            return self.dropout(jnp.tanh(self.linear(x)), key=key)

    model = Net(eqx.nn.Linear(3, 8, key=jax.random.key(19)), eqx.nn.Dropout(0.5))

    def loss(model, x, key):
        return jnp.sum(jax.vmap(model)(x, jax.random.split(key, x.shape[0])) ** 2)

    x, key = normal(20, 4, 3), jax.random.key(21)
    inference = eqx.nn.inference_mode(model)
    strict = ad.prepare(ad.gradient, loss, Active(model), Constant(x), Constant(key))
    with pytest.raises(ad.PreparationMismatchError, match=r"\.dropout"):
        strict(inference, x, key)
    lenient = ad.prepare(ad.gradient, loss, Active(model), Constant(x), Constant(key), strict=False)
    assert_trees(lenient(model, x, key), eqx.filter_grad(loss)(model, x, key))
    assert_trees(lenient(inference, x, key), eqx.filter_grad(loss)(inference, x, key))


# ----------------------------------------------------------------------- Flax Linen


class ScannedRecurrent(linen.Module):
    @linen.compact
    def __call__(self, xs):
        class Block(linen.Module):
            @linen.compact
            def __call__(self, carry, x):
                carry = linen.LayerNorm()(jnp.tanh(linen.Dense(4)(carry)) + x)
                return carry, carry

        stack = linen.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2, in_axes=linen.broadcast)
        carry, _ = stack()(xs[:, 0], xs[:, 0])
        return linen.RNN(linen.LSTMCell(3))(xs + carry[:, None])


def test_linen_scanned_layers_and_an_lstm_rnn():
    xs, new_xs = normal(22, 2, 3, 4), normal(23, 2, 3, 4)
    params = ScannedRecurrent().init(jax.random.key(24), xs)["params"]
    before = snapshot(params)

    def loss(params, xs):
        return jnp.sum(ScannedRecurrent().apply({"params": params}, xs) ** 2)

    assert_trees(ad.gradient(loss, Active(params), Constant(xs)), jax.grad(loss)(params, xs))
    prepared = ad.prepare(ad.value_and_gradient, loss, Active(params), Constant(xs), strict=False)
    assert_trees(prepared(params, new_xs), jax.value_and_grad(loss)(params, new_xs))
    assert_unchanged(params, before)


# ---------------------------------------------------------------- Haiku and optax


def test_haiku_lstm_unrolled_in_an_optax_loop_with_a_prepared_value_and_gradient():
    def forward(xs):
        core = hk.LSTM(3)
        outputs, _ = hk.dynamic_unroll(core, xs, core.initial_state(xs.shape[1]), time_major=True)
        return hk.Linear(1)(outputs)

    network = hk.without_apply_rng(hk.transform(forward))
    xs = normal(25, 3, 2, 4)
    params = network.init(jax.random.key(26), xs)
    before = snapshot(params)

    def loss(params, xs):
        return jnp.mean((network.apply(params, xs) - 1.0) ** 2)

    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    step = ad.prepare(ad.value_and_gradient, loss, Active(params), Constant(xs))
    ours, theirs = params, params
    ours_state, theirs_state = optimizer.init(ours), optimizer.init(theirs)
    raw_step = jax.jit(jax.value_and_grad(loss))
    for seed in range(2):
        batch = normal(100 + seed, 3, 2, 4)
        value, grads = step(ours, batch)
        expected_value, expected_grads = raw_step(theirs, batch)
        np.testing.assert_allclose(value, expected_value, **CLOSE)
        assert_trees(grads, expected_grads)
        updates, ours_state = optimizer.update(grads, ours_state, ours)
        ours = optax.apply_updates(ours, updates)
        updates, theirs_state = optimizer.update(expected_grads, theirs_state, theirs)
        theirs = optax.apply_updates(theirs, updates)
    assert_trees(ours, theirs)
    assert_unchanged(params, before)

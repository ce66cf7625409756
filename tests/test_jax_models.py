"""AutoJAX on the models JAX users bring: Equinox, Flax NNX, Flax Linen, Haiku, optax.

Every expected value comes from the model library's own differentiation
(``eqx.filter_grad``, ``eqx.filter_value_and_grad``, ``nnx.grad``, ``jax.grad`` on a
Linen or Haiku ``apply``) or from an analytic formula, never from ``activity``.
Each comparison checks the tree *structure* first (the result is the library's own
type: an Equinox module with ``None`` where ``eqx.filter_grad`` has ``None``, an
``nnx.State``), then every leaf's dtype, shape and value.
"""

from __future__ import annotations

import functools

import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import linen
from flax import nnx

import activity as ad
from activity import Active, Cache, Constant

ALL_CLOSE = dict(rtol=1e-5, atol=1e-6)
BF16_CLOSE = dict(rtol=2e-2, atol=2e-2)


def keys(seed: int, n: int):
    return jax.random.split(jax.random.key(seed), n)


def normal(seed: int, *shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


# ------------------------------------------------------------------ comparisons and snapshots


def _is_key(leaf) -> bool:
    return isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def assert_trees(actual, expected, *, rtol=ALL_CLOSE["rtol"], atol=ALL_CLOSE["atol"]):
    """Same pytree type and structure (``None`` positions included), then leaf by leaf."""
    assert type(actual) is type(expected), f"{type(actual).__name__} != {type(expected).__name__}"
    actual_def = jax.tree_util.tree_structure(actual)
    expected_def = jax.tree_util.tree_structure(expected)
    assert actual_def == expected_def, f"structure\n  {actual_def}\n!= expected\n  {expected_def}"
    compared = []

    def leaf(path, a, e):
        where = jax.tree_util.keystr(path)
        assert isinstance(a, jax.Array), f"{where}: {type(a).__name__} is not a jax.Array"
        assert a.dtype == e.dtype, f"{where}: dtype {a.dtype} != {e.dtype}"
        assert a.shape == e.shape, f"{where}: shape {a.shape} != {e.shape}"
        if _is_key(e):
            np.testing.assert_array_equal(jax.random.key_data(a), jax.random.key_data(e), err_msg=where)
        else:
            np.testing.assert_allclose(
                np.asarray(a, np.float64), np.asarray(e, np.float64), rtol=rtol, atol=atol, err_msg=where
            )
            compared.append(where)

    jax.tree_util.tree_map_with_path(leaf, actual, expected)
    assert compared, "no leaf compared"


def _copy_leaf(leaf):
    if _is_key(leaf):
        return ("key", str(leaf.dtype), np.array(jax.random.key_data(leaf)))
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        return ("array", str(leaf.dtype), np.array(leaf))
    return ("leaf", type(leaf), leaf)


def snapshot(value):
    """A copy of everything in ``value``: an NNX module through ``nnx.split``, any pytree's leaves."""
    if isinstance(value, nnx.Module):
        graphdef, state = nnx.split(value)
        return ("nnx", graphdef, snapshot(state))
    leaves, treedef = jax.tree_util.tree_flatten(value)
    return (treedef, [_copy_leaf(leaf) for leaf in leaves])


def assert_unchanged(value, before):
    after = snapshot(value)
    if before[0] == "nnx":
        assert after[0] == "nnx" and after[1] == before[1], "the NNX graph changed"
        before, after = before[2], after[2]
    assert after[0] == before[0], "the pytree structure changed"
    for i, (b, a) in enumerate(zip(before[1], after[1])):
        assert a[:2] == b[:2], f"leaf {i}: {a[:2]} != {b[:2]}"
        if b[0] == "leaf":
            assert a[2] is b[2] or a[2] == b[2], f"leaf {i} changed: {b[2]!r} -> {a[2]!r}"
        else:
            np.testing.assert_array_equal(a[2], b[2], err_msg=f"leaf {i} changed")


def check_gradient(loss, model, data, new_data, expected, **kwargs):
    """``ad.gradient`` on ``Active(model), *Constant(data)``, unprepared, then prepared and
    called on ``new_data``; ``expected(model, *data)`` is the library's own gradient
    (with aux where ``has_aux``). The model must be unchanged after each call."""
    before = snapshot(model)
    result = ad.gradient(loss, Active(model), *map(Constant, data), **kwargs)
    assert_trees(result, expected(model, *data))
    assert_unchanged(model, before)
    prepared = ad.prepare(ad.gradient, loss, Active(model), *map(Constant, data), **kwargs)
    assert_trees(prepared(model, *new_data), expected(model, *new_data))
    assert_unchanged(model, before)
    return result


# ------------------------------------------------------------------------------- Equinox


def mean_squares(model, x):
    return jnp.mean(jax.vmap(model)(x) ** 2)


@pytest.fixture(scope="module")
def eqx_mlp():
    return eqx.nn.MLP(3, 2, 8, 2, activation=jnp.tanh, key=jax.random.key(0))


def test_equinox_mlp(eqx_mlp):
    g = check_gradient(mean_squares, eqx_mlp, [normal(1, 5, 3)], [normal(2, 5, 3)], eqx.filter_grad(mean_squares))
    assert isinstance(g, eqx.nn.MLP) and g.activation is None and g.final_activation is None


def test_equinox_value_and_gradient_equals_filter_value_and_grad(eqx_mlp):
    x = normal(3, 5, 3)
    (value, grads) = ad.value_and_gradient(mean_squares, Active(eqx_mlp), Constant(x))
    expected_value, expected_grads = eqx.filter_value_and_grad(mean_squares)(eqx_mlp, x)
    np.testing.assert_allclose(value, expected_value, **ALL_CLOSE)
    assert_trees(grads, expected_grads)


def test_equinox_conv2d():
    conv = eqx.nn.Conv2d(2, 3, kernel_size=3, padding=1, key=jax.random.key(4))

    def loss(conv, x):
        return jnp.sum(jnp.tanh(jax.vmap(conv)(x)) ** 2)

    g = check_gradient(loss, conv, [normal(5, 2, 2, 6, 6)], [normal(6, 2, 2, 6, 6)], eqx.filter_grad(loss))
    assert isinstance(g, eqx.nn.Conv2d) and g.weight.shape == conv.weight.shape


def test_equinox_lstm_cell_scanned_over_a_sequence():
    cell = eqx.nn.LSTMCell(3, 4, key=jax.random.key(7))

    def loss(cell, xs):
        def step(carry, x):
            h, c = cell(x, carry)
            return (h, c), h

        _, hs = jax.lax.scan(step, (jnp.zeros(4), jnp.zeros(4)), xs)
        return jnp.sum(hs**2)

    check_gradient(loss, cell, [normal(8, 6, 3)], [normal(9, 6, 3)], eqx.filter_grad(loss))


@pytest.fixture(scope="module")
def eqx_attention():
    return eqx.nn.MultiheadAttention(2, 8, dropout_p=0.1, key=jax.random.key(10))


def test_equinox_multihead_attention_in_inference(eqx_attention):
    def loss(attention, x):
        return jnp.sum(jnp.sin(attention(x, x, x, inference=True)))

    g = check_gradient(loss, eqx_attention, [normal(11, 4, 8)], [normal(12, 4, 8)], eqx.filter_grad(loss))
    assert g.dropout.p is None  # a Python float: a hyper-parameter, as for eqx.filter_grad


def test_equinox_multihead_attention_in_training_with_a_typed_key(eqx_attention):
    def loss(attention, x, key):
        return jnp.sum(jnp.sin(attention(x, x, x, key=key)))

    k1, k2 = keys(13, 2)
    check_gradient(loss, eqx_attention, [normal(14, 4, 8), k1], [normal(15, 4, 8), k2], eqx.filter_grad(loss))
    # the dropout really is on: another key gives another gradient
    g1, g2 = (eqx.filter_grad(loss)(eqx_attention, normal(14, 4, 8), k) for k in (k1, k2))
    assert not np.allclose(g1.query_proj.weight, g2.query_proj.weight)


class BatchNormNet(eqx.Module):
    first: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    last: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.first = eqx.nn.Linear(3, 4, use_bias=False, key=k1)  # a bias before BatchNorm has gradient 0
        self.norm = eqx.nn.BatchNorm(4, "batch", mode="batch")
        self.last = eqx.nn.Linear(4, 1, key=k2)

    def __call__(self, x, state):
        h, state = self.norm(self.first(x), state)
        return self.last(jnp.tanh(h)), state


def batch_norm_loss(net, state, x):
    out, new_state = jax.vmap(net, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
    return jnp.mean((out - 1.0) ** 2), new_state


@pytest.fixture(scope="module")
def eqx_batch_norm():
    return eqx.nn.make_with_state(BatchNormNet)(jax.random.key(16))


def test_equinox_batch_norm_with_state_as_constant_and_new_state_as_aux(eqx_batch_norm):
    net, state = eqx_batch_norm
    before = snapshot(state)
    (grads, new_state) = check_gradient(
        batch_norm_loss, net, [state, normal(17, 6, 3)], [state, normal(18, 6, 3)],
        eqx.filter_grad(batch_norm_loss, has_aux=True), has_aux=True,
    )
    assert isinstance(new_state, eqx.nn.State)
    assert_unchanged(state, before)
    assert grads.norm.weight is not None and grads.norm.weight.shape == (4,)


def test_equinox_batch_norm_with_state_as_cache_keeps_int_counters(eqx_batch_norm):
    net, state = eqx_batch_norm
    x = normal(19, 6, 3)
    seen = []

    def loss(net, state, x):
        seen.append([leaf.dtype for leaf in jax.tree_util.tree_leaves(state)])
        return batch_norm_loss(net, state, x)

    expected_grads, expected_state = eqx.filter_grad(batch_norm_loss, has_aux=True)(net, state, x)
    dtypes = [leaf.dtype for leaf in jax.tree_util.tree_leaves(state)]
    assert jnp.int32 in dtypes  # the batch counter
    for run in (
        lambda: ad.gradient(loss, Active(net), Cache(state), Constant(x), has_aux=True),
        lambda: ad.prepare(ad.gradient, loss, Active(net), Cache(state), Constant(x), has_aux=True)(net, state, x),
    ):
        seen.clear()
        grads, new_state = run()
        assert seen and all(s == dtypes for s in seen), f"f saw state dtypes {seen}, expected {dtypes}"
        # in training mode the output uses batch statistics: the Cache's content does not matter
        assert_trees(grads, expected_grads)
        assert jax.tree_util.tree_structure(new_state) == jax.tree_util.tree_structure(expected_state)
        assert [leaf.dtype for leaf in jax.tree_util.tree_leaves(new_state)] == dtypes


class Scaled(eqx.Module):
    weight: jax.Array
    scale: float

    def __call__(self, x):
        if self.scale > 1:  # a Python float: a concrete value inside f, under jit as well
            return self.scale * jnp.tanh(x @ self.weight)
        return x @ self.weight


def scaled_loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


@pytest.mark.parametrize("scale", [2.0, 0.5])
def test_equinox_float_field_is_static(scale):
    model = Scaled(normal(20, 3, 2), scale)
    data = [normal(21, 5, 3), normal(22, 5, 2)]
    new_data = [normal(23, 5, 3), normal(24, 5, 2)]
    g = check_gradient(scaled_loss, model, data, new_data, eqx.filter_grad(scaled_loss))
    assert g.scale is None and isinstance(g, Scaled)


def test_equinox_sgd_loop_keeps_the_float_field():
    model = expected = Scaled(normal(25, 3, 2), 2.0)
    x, y = normal(26, 5, 3), normal(27, 5, 2)
    step = ad.prepare(ad.gradient, scaled_loss, Active(model), Constant(x), Constant(y))
    sgd = functools.partial(jax.tree_util.tree_map, lambda g: -0.1 * g)
    for _ in range(10):
        model = eqx.apply_updates(model, sgd(step(model, x, y)))
        expected = eqx.apply_updates(expected, sgd(eqx.filter_grad(scaled_loss)(expected, x, y)))
    assert type(model.scale) is float and model.scale == 2.0
    np.testing.assert_allclose(model.weight, expected.weight, **ALL_CLOSE)
    assert scaled_loss(model, x, y) < scaled_loss(Scaled(normal(25, 3, 2), 2.0), x, y)


# ------------------------------------------------------------------------------- Flax NNX


def nnx_loss(model, x):
    return jnp.mean(jnp.sin(model(x)) ** 2)


def nnx_expected(loss, **grad_kwargs):
    """``nnx.grad`` on a clone: in train mode it updates the model (statistics, RNG counts)."""

    def expected(model, *data):
        return nnx.grad(loss, **grad_kwargs)(nnx.clone(model), *data)

    return expected


def test_nnx_linear():
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    g = check_gradient(nnx_loss, model, [normal(30, 4, 3)], [normal(31, 4, 3)], nnx_expected(nnx_loss))
    assert isinstance(g, nnx.State) and set(g) == {"kernel", "bias"}
    seen = []

    def loss(m, x):
        seen.append(type(m) is nnx.Linear and m is not model)
        return nnx_loss(m, x)

    ad.gradient(loss, Active(model), Constant(normal(30, 4, 3)))
    assert seen == [True]  # f gets a copy rebuilt by nnx.merge, never the user's module


def test_nnx_conv():
    model = nnx.Conv(2, 3, kernel_size=(3, 3), rngs=nnx.Rngs(1))
    g = check_gradient(nnx_loss, model, [normal(32, 2, 5, 5, 2)], [normal(33, 2, 5, 5, 2)], nnx_expected(nnx_loss))
    assert isinstance(g, nnx.State)


class NNXBatchNormNet(nnx.Module):
    def __init__(self, rngs):
        self.first = nnx.Linear(3, 4, use_bias=False, rngs=rngs)  # a bias before BatchNorm has gradient 0
        self.norm = nnx.BatchNorm(4, rngs=rngs)
        self.last = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x):
        return self.last(jnp.tanh(self.norm(self.first(x))))


def nnx_stats_loss(model, x):
    return jnp.mean((model(x) - 1.0) ** 2), nnx.state(model, nnx.BatchStat)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_nnx_batch_norm(mode):
    model = NNXBatchNormNet(nnx.Rngs(2))
    getattr(model, mode)()
    # warm the statistics so that eval mode does not normalise with mean 0, variance 1
    model.norm.mean[...] = normal(34, 4)
    model.norm.var[...] = 1.0 + normal(35, 4) ** 2
    grads, stats = check_gradient(
        nnx_stats_loss, model, [normal(36, 8, 3)], [normal(37, 8, 3)],
        nnx_expected(nnx_stats_loss, has_aux=True), has_aux=True,
    )
    assert isinstance(grads, nnx.State) and isinstance(stats, nnx.State)
    moved = not np.allclose(stats["norm"]["mean"][...], model.norm.mean[...])
    assert moved == (mode == "train")  # the new statistics come back as aux, the model keeps its own
    nnx.update(model, stats)  # the user applies them
    np.testing.assert_allclose(model.norm.mean[...], stats["norm"]["mean"][...])


class NNXDropoutNet(nnx.Module):
    def __init__(self, rngs):
        self.first = nnx.Linear(3, 16, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.last = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.last(self.dropout(jnp.tanh(self.first(x))))


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_nnx_dropout_with_rngs(mode):
    model = NNXDropoutNet(nnx.Rngs(params=3, dropout=4))
    getattr(model, mode)()
    x = normal(38, 4, 3)
    check_gradient(nnx_loss, model, [x], [normal(39, 4, 3)], nnx_expected(nnx_loss))
    # activity never writes the RNG count back: the same call gives the same mask again
    g1 = ad.gradient(nnx_loss, Active(model), Constant(x))
    g2 = ad.gradient(nnx_loss, Active(model), Constant(x))
    assert_trees(g1, g2, rtol=0, atol=0)
    if mode == "train":  # the mask does depend on the RNG count: nnx.grad advances it
        twice = nnx.clone(model)
        first = nnx.grad(nnx_loss)(twice, x)
        second = nnx.grad(nnx_loss)(twice, x)
        assert not np.allclose(first["first"]["kernel"][...], second["first"]["kernel"][...])
        assert_trees(g1, first)


def test_nnx_multi_head_attention():
    model = nnx.MultiHeadAttention(2, 8, qkv_features=8, decode=False, rngs=nnx.Rngs(5))
    g = check_gradient(nnx_loss, model, [normal(40, 2, 4, 8)], [normal(41, 2, 4, 8)], nnx_expected(nnx_loss))
    assert isinstance(g, nnx.State)


class TiedEmbedding(nnx.Module):
    def __init__(self, rngs):
        embed = nnx.Embed(10, 4, rngs=rngs)
        self.encoder = embed
        self.hidden = nnx.Linear(4, 4, rngs=rngs)
        self.decoder = embed  # the same Embed: one parameter used twice

    def __call__(self, ids):
        return self.decoder.attend(jnp.tanh(self.hidden(self.encoder(ids))))


def tied_loss(model, ids):
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(model(ids), ids))


@pytest.fixture(scope="module")
def tied():
    return TiedEmbedding(nnx.Rngs(6))


def test_nnx_tied_weights_once(tied):
    ids, new_ids = jnp.array([0, 3, 9, 4]), jnp.array([1, 1, 7, 2])
    g = check_gradient(tied_loss, tied, [ids], [new_ids], nnx_expected(tied_loss))
    leaves = jax.tree_util.tree_leaves(g)
    assert len(leaves) == len(jax.tree_util.tree_leaves(nnx.state(tied, nnx.Param))) == 3


def test_nnx_optimizer_update_accepts_the_result(tied):
    ids = jnp.array([0, 3, 9, 4])
    ours, theirs = nnx.clone(tied), nnx.clone(tied)
    ours_opt = nnx.Optimizer(ours, optax.adam(1e-3), wrt=nnx.Param)
    theirs_opt = nnx.Optimizer(theirs, optax.adam(1e-3), wrt=nnx.Param)
    step = ad.prepare(ad.gradient, tied_loss, Active(ours), Constant(ids))
    for _ in range(3):
        ours_opt.update(ours, step(ours, ids))
        theirs_opt.update(theirs, nnx.grad(tied_loss)(theirs, ids))
    assert_trees(nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param))
    assert not np.allclose(nnx.state(ours, nnx.Param)["hidden"]["kernel"][...], tied.hidden.kernel[...])


def test_nnx_split_recipe(tied):
    graphdef, params, rest = nnx.split(tied, nnx.Param, ...)

    def split_loss(params, graphdef, rest, ids):
        return tied_loss(nnx.merge(graphdef, params, rest), ids)

    ids, new_ids = jnp.array([0, 3, 9, 4]), jnp.array([1, 1, 7, 2])
    expected = nnx.grad(tied_loss)(nnx.clone(tied), ids)
    g = ad.gradient(split_loss, Active(params), Constant(graphdef), Constant(rest), Constant(ids))
    assert_trees(g, expected)
    prepared = ad.prepare(ad.gradient, split_loss, Active(params), Constant(graphdef), Constant(rest), Constant(ids))
    assert_trees(prepared(params, graphdef, rest, new_ids), nnx.grad(tied_loss)(nnx.clone(tied), new_ids))
    assert_trees(g, ad.gradient(tied_loss, Active(tied), Constant(ids)))


def test_nnx_tangent_of_the_wrong_structure_names_the_path():
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(7))
    x = normal(42, 4, 3)
    params = nnx.state(model, nnx.Param)
    missing_bias = nnx.State({"kernel": params["kernel"]})
    wrong_shape = jax.tree_util.tree_map(lambda a: jnp.ones(a.shape[:1]), params)
    for tangent, path in [(missing_bias, "bias"), (wrong_shape, "kernel"), ({"kernel": jnp.ones((3, 2))}, "bias")]:
        for op in (ad.pushforward, ad.hvp):
            with pytest.raises(ValueError) as info:
                op(nnx_loss, Active(model), Constant(x), tangent=tangent)
            message = str(info.value)
            assert "\n" not in message and len(message) < 300, message
            assert path in message, message


# ------------------------------------------------------------------------------ Flax Linen


class LinenNet(linen.Module):
    @linen.compact
    def __call__(self, x, train: bool):
        x = linen.Dense(8, use_bias=False)(x)
        x = linen.BatchNorm(use_running_average=not train)(x)
        x = linen.Dropout(0.3, deterministic=not train)(jnp.tanh(x))
        return linen.Dense(1)(x)


def linen_loss(params, batch_stats, key, x):
    out, updates = LinenNet().apply(
        {"params": params, "batch_stats": batch_stats}, x, train=True,
        rngs={"dropout": key}, mutable=["batch_stats"],
    )
    return jnp.mean((out - 1.0) ** 2), updates["batch_stats"]


def test_linen_dense_batch_norm_dropout():
    x = normal(50, 6, 3)
    variables = LinenNet().init(jax.random.key(51), x, train=False)
    params, batch_stats = variables["params"], variables["batch_stats"]
    k1, k2 = keys(52, 2)
    expected = jax.grad(linen_loss, has_aux=True)
    before = snapshot(variables)
    args = Active(params), Constant(batch_stats), Constant(k1), Constant(x)
    assert_trees(ad.gradient(linen_loss, *args, has_aux=True), expected(params, batch_stats, k1, x))
    prepared = ad.prepare(ad.gradient, linen_loss, *args, has_aux=True)
    x2 = normal(53, 6, 3)
    grads, new_stats = prepared(params, batch_stats, k2, x2)
    assert_trees((grads, new_stats), expected(params, batch_stats, k2, x2))
    assert_unchanged(variables, before)
    assert not np.allclose(new_stats["BatchNorm_0"]["mean"], batch_stats["BatchNorm_0"]["mean"])


# ------------------------------------------------------------------------------------ Haiku


def haiku_forward(x, is_training):
    x = hk.Linear(8, with_bias=False)(x)
    x = hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.9)(x, is_training)
    return hk.Linear(1)(jnp.tanh(x))


HAIKU = hk.transform_with_state(haiku_forward)


def haiku_loss(params, state, x):
    out, new_state = HAIKU.apply(params, state, None, x, True)
    return jnp.mean((out - 1.0) ** 2), new_state


def test_haiku_transform_with_state():
    x = normal(60, 6, 3)
    params, state = HAIKU.init(jax.random.key(61), x, True)
    before = snapshot((params, state))
    expected = jax.grad(haiku_loss, has_aux=True)
    assert_trees(ad.gradient(haiku_loss, Active(params), Constant(state), Constant(x), has_aux=True),
                 expected(params, state, x))
    prepared = ad.prepare(ad.gradient, haiku_loss, Active(params), Constant(state), Constant(x), has_aux=True)
    x2 = normal(62, 6, 3)
    assert_trees(prepared(params, state, x2), expected(params, state, x2))
    assert_unchanged((params, state), before)


# --------------------------------------------------------------------------- typed PRNG keys

W = jnp.array([0.5, -1.0, 2.0])
TANGENT = jnp.array([1.0, 2.0, -1.0])
COTANGENT = jnp.array([0.3, -0.2, 1.0])


def noise(key):
    return jax.random.normal(key, (3,))


def analytic(op, n):
    """The results for ``sum(w**2 * n)`` (scalar ops) and ``w * n`` (vector ops), noise ``n``."""
    return {
        "gradient": 2 * W * n,
        "value_and_gradient": (jnp.sum(W**2 * n), 2 * W * n),
        "hvp": 2 * n * TANGENT,
        "hessian": jnp.diag(2 * n),
        "jacobian": jnp.diag(n),
        "pushforward": n * TANGENT,
        "pullback": n * COTANGENT,
    }[op]


VECTOR_OPS = {"jacobian", "pushforward", "pullback"}
OPERATOR_KWARGS = {"hvp": "tangent", "pushforward": "tangent", "pullback": "cotangent"}


def _kwargs(op, in_tree):
    if op not in OPERATOR_KWARGS:
        return {}
    value = COTANGENT if op == "pullback" else TANGENT
    if in_tree and op != "pullback":
        value = {"w": value, "key": None}
    return {OPERATOR_KWARGS[op]: value}


def _in_tree(op, value):
    """Where the key is inside the Active dict, the input-shaped parts of the result are dicts."""
    if op == "value_and_gradient":
        return (value[0], {"w": value[1], "key": None})
    if op == "hessian":
        return {"w": {"w": value, "key": None}, "key": None}
    if op == "pushforward":
        return value
    return {"w": value, "key": None}


@pytest.mark.parametrize("where", ["constant", "inside_active"])
@pytest.mark.parametrize(
    "op", ["gradient", "value_and_gradient", "jacobian", "pushforward", "pullback", "hvp", "hessian"]
)
def test_typed_keys(op, where):
    traces = []
    vector = op in VECTOR_OPS

    def body(w, key):
        traces.append(1)
        return w * noise(key) if vector else jnp.sum(w**2 * noise(key))

    in_tree = where == "inside_active"
    if in_tree:
        def f(p):
            return body(p["w"], p["key"])

        def args(w, key):
            return (Active({"w": w, "key": key}),)
    else:
        f = body

        def args(w, key):
            return Active(w), Constant(key)

    operator = getattr(ad, op)
    k1, k2 = keys(70, 2)
    expect = (lambda k: _in_tree(op, analytic(op, noise(k)))) if in_tree else (lambda k: analytic(op, noise(k)))
    before = snapshot(k1)
    assert_trees(operator(f, *args(W, k1), **_kwargs(op, in_tree)), expect(k1))
    # the tangent given to prepare only fixes its structure; each call passes its own
    placeholder = jax.tree_util.tree_map(jnp.ones_like, _kwargs(op, in_tree))
    prepared = ad.prepare(operator, f, *args(W, k1), **placeholder)
    assert_trees(prepared(*args(W, k1), **_kwargs(op, in_tree)), expect(k1))
    count = len(traces)
    raw = [annotated.value for annotated in args(W, k2)]  # raw values take the prepared kinds
    assert_trees(prepared(*raw, **_kwargs(op, in_tree)), expect(k2))  # a new key: new noise, no retrace
    assert len(traces) == count, f"a new key retraced f ({len(traces) - count} more traces)"
    assert_unchanged(k1, before)


# -------------------------------------------------------------------------------- bfloat16


def test_bfloat16_array():
    x = normal(80, 5, dtype=jnp.bfloat16)

    def f(x):
        return jnp.sum(jnp.sin(x) * x)

    g = ad.gradient(f, Active(x))
    assert g.dtype == jnp.bfloat16
    assert_trees(g, jax.grad(f)(x), **BF16_CLOSE)
    assert_trees(ad.prepare(ad.gradient, f, Active(x))(2 * x), jax.grad(f)(2 * x), **BF16_CLOSE)


def test_bfloat16_equinox_mlp():
    mlp = eqx.nn.MLP(3, 2, 8, 1, activation=jnp.tanh, dtype=jnp.bfloat16, key=jax.random.key(81))
    x, x2 = normal(82, 4, 3, dtype=jnp.bfloat16), normal(83, 4, 3, dtype=jnp.bfloat16)

    def loss(m, x):
        return jnp.mean(jax.vmap(m)(x).astype(jnp.float32) ** 2)

    g = ad.gradient(loss, Active(mlp), Constant(x))
    assert_trees(g, eqx.filter_grad(loss)(mlp, x), **BF16_CLOSE)
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree_util.tree_leaves(g))
    prepared = ad.prepare(ad.gradient, loss, Active(mlp), Constant(x))
    assert_trees(prepared(mlp, x2), eqx.filter_grad(loss)(mlp, x2), **BF16_CLOSE)


def test_bfloat16_mixed_dict():
    params = {"f32": normal(84, 3), "bf16": normal(85, 3, dtype=jnp.bfloat16)}

    def f(p):
        return jnp.sum(p["f32"] * jnp.sin(p["bf16"]).astype(jnp.float32))

    g = ad.gradient(f, Active(params))
    assert g["bf16"] is not None and g["bf16"].dtype == jnp.bfloat16 and g["f32"].dtype == jnp.float32
    assert_trees(g, jax.grad(f)(params), **BF16_CLOSE)
    _, g2 = ad.prepare(ad.value_and_gradient, f, Active(params))(params)
    assert_trees(g2, jax.grad(f)(params), **BF16_CLOSE)


def test_numpy_ml_dtypes_bfloat16_with_autojax():
    x = np.array([0.5, -1.0, 2.0], dtype=ml_dtypes.bfloat16)

    def f(x):
        return jnp.sum(jnp.sin(x) * x)

    g = ad.gradient(f, Active(x), backend=ad.AutoJAX())
    assert g is not None and g.dtype == ml_dtypes.bfloat16
    expected = jax.grad(f)(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(expected, np.float64), **BF16_CLOSE)


# ------------------------------------------------------------------------------------ optax


def test_optax_adam_loop_equals_the_hand_written_one():
    model0 = eqx.nn.MLP(2, 1, 8, 1, activation=jnp.tanh, key=jax.random.key(90))
    x = jax.random.uniform(jax.random.key(91), (32, 2), minval=-1, maxval=1)
    y = x[:, :1] - 0.5 * x[:, 1:]

    def loss(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    opt = optax.adam(1e-2)

    def train(value_and_grad):
        model = model0
        opt_state = opt.init(eqx.filter(model, eqx.is_inexact_array))
        losses = []
        for _ in range(50):
            value, grads = value_and_grad(model)
            updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
            model = eqx.apply_updates(model, updates)
            losses.append(float(value))
        return np.array(losses)

    step = ad.prepare(ad.value_and_gradient, loss, Active(model0), Constant(x), Constant(y))
    ours = train(lambda model: step(model, x, y))

    params0, static = eqx.partition(model0, eqx.is_inexact_array)
    hand = jax.jit(jax.value_and_grad(lambda params, x, y: loss(eqx.combine(params, static), x, y)))
    theirs = train(lambda model: hand(eqx.filter(model, eqx.is_inexact_array), x, y))

    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    assert np.all(np.diff(ours) < 0) and ours[-1] < 0.1 * ours[0], ours

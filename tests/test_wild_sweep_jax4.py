"""AutoJAX on third-party JAX models and inputs the other model tests do not cover (round 4):
Python hyper-parameters inside an Active model across prepared calls (lenient and strict),
and the new kinds of input the sweep found working (Flax NNX transformer pieces, Linen
``TrainState``, Equinox state and ensembles, Haiku state, plain JAX control flow).

Every expected value comes from the model library's own differentiation (``nnx.grad``,
``eqx.filter_grad``, ``jax.grad`` / ``jax.jvp``), never from ``activity``.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import activity as ad
from activity import Active, Constant

from _sweeps import assert_trees, normal


# ------------------------------------------- Python hyper-parameters inside an Active model


class Scaled(eqx.Module):
    weight: jax.Array
    scale: float  # a Python float field: static, as eqx.filter_grad and eqx.filter_jit treat it

    def __call__(self, x):
        return self.scale * jnp.sum(jnp.tanh(x @ self.weight))


def scaled_loss(model, x):
    return model(x) ** 2


def test_a_lenient_prepared_call_sees_a_changed_python_hyper_parameter_of_an_active_model():
    """It reused the value prepared with (a wrong gradient, silently): the signature a lenient
    call looks its plan up by counted the float as a differentiated array, so 2.0 and 3.0 looked alike."""
    x = normal(0, 4, 3)
    model = Scaled(0.1 * normal(1, 3, 2), 2.0)
    prepared = ad.prepare(ad.gradient, scaled_loss, Active(model), Constant(x), strict=False)
    for scale in (2.0, 3.0, 5.0, 2.0):
        changed = Scaled(model.weight, scale)
        assert_trees(prepared(changed, x), eqx.filter_grad(scaled_loss)(changed, x))

    tree = {"weight": jnp.ones(3), "scale": 2.0}  # the same in a plain dict

    def dict_loss(tree):
        return tree["scale"] * jnp.sum(tree["weight"] ** 2)

    prepared = ad.prepare(ad.gradient, dict_loss, Active(tree), strict=False)
    for scale in (2.0, 3.0):
        changed = {"weight": tree["weight"], "scale": scale}
        expected = {"weight": jax.grad(dict_loss)(changed)["weight"], "scale": None}
        assert_trees(prepared(changed), expected)


def test_a_lenient_prepared_call_with_the_prepared_values_reuses_the_prepared_plan():
    """A model with a Python float (``eqx.nn.Dropout.p``) was prepared a second time on its first call."""
    traced = []

    class Net(eqx.Module):
        linear: eqx.nn.Linear
        dropout: eqx.nn.Dropout

    def loss(model, x):
        traced.append(None)
        return jnp.sum(model.dropout(jax.vmap(model.linear)(x), inference=True) ** 2)

    model = Net(eqx.nn.Linear(3, 2, key=jax.random.key(2)), eqx.nn.Dropout(0.5))
    x = normal(3, 4, 3)
    expected = eqx.filter_grad(loss)(model, x)
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(x), strict=False)
    count = len(traced)
    for _ in range(3):
        assert_trees(prepared(model, x), expected)
    assert len(traced) == count, "f traced again for the values it was prepared with"


def test_a_strict_prepared_call_names_the_hyper_parameter_that_changed():
    """``eqx.nn.inference_mode`` flips ``Dropout.inference``; the message named ``.dropout.p`` (unchanged)
    and called it a float32 array."""

    class Net(eqx.Module):
        linear: eqx.nn.Linear
        dropout: eqx.nn.Dropout

    def loss(model, x, key):
        return jnp.sum(model.dropout(jax.vmap(model.linear)(x), key=key) ** 2)

    model = Net(eqx.nn.Linear(3, 2, key=jax.random.key(4)), eqx.nn.Dropout(0.5))
    x, key = normal(5, 4, 3), jax.random.key(6)
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(x), Constant(key))
    with pytest.raises(ad.PreparationMismatchError, match=r"at \.dropout\.inference: expected the value False, got the value True"):
        prepared(eqx.nn.inference_mode(model), x, key)
    with pytest.raises(ad.PreparationMismatchError, match=r"at \.scale: expected the value 2\.0, got the value 3\.0"):
        scaled = Scaled(normal(7, 3, 2), 2.0)
        ad.prepare(ad.gradient, scaled_loss, Active(scaled), Constant(x))(Scaled(scaled.weight, 3.0), x)


def test_a_train_state_step_counter_named_with_the_way_to_let_it_change():
    """``TrainState.create`` starts ``step`` as the Python int 0 and ``apply_gradients`` outside
    ``jax.jit`` makes it 1: a static value, so a strict prepared call refuses it, naming it and
    saying how to pass a counter that changes; a lenient one and one with an array step agree
    with ``jax.grad`` on the params."""
    import optax
    from flax import linen
    from flax.training import train_state

    layer = linen.Dense(3)
    x = normal(8, 4, 2)
    state = train_state.TrainState.create(apply_fn=layer.apply, params=layer.init(jax.random.key(9), x), tx=optax.sgd(0.1))

    def loss(state, x):
        return jnp.sum(jnp.tanh(state.apply_fn(state.params, x)) ** 2)

    def expected(state):
        return jax.grad(lambda params: loss(state.replace(params=params), x))(state.params)

    result = ad.gradient(loss, Active(state, where=lambda path, leaf: path.startswith(".params")), Constant(x))
    assert result.step is None and jax.tree_util.tree_leaves(result.opt_state) == []
    assert_trees(result.params, expected(state))
    stepped = state.apply_gradients(grads=result.params)
    strict = ad.prepare(ad.gradient, loss, Active(state), Constant(x))
    with pytest.raises(ad.PreparationMismatchError, match=r"at \.step: expected the value 0, got the value 1\. .*jnp\.asarray"):
        strict(stepped, x)
    lenient = ad.prepare(ad.gradient, loss, Active(state), Constant(x), strict=False)
    assert_trees(lenient(stepped, x).params, expected(stepped))
    counted = state.replace(step=jnp.asarray(0))
    prepared = ad.prepare(ad.gradient, loss, Active(counted), Constant(x))
    stepped = counted.apply_gradients(grads=prepared(counted, x).params)
    assert_trees(prepared(stepped, x).params, expected(stepped))


# --------------------------------------------------------------- activity.testing.check


def test_check_leaves_an_nnx_module_rng_count_and_batch_statistics_as_they_were():
    """check ran f once on the user's own module to see its output: the dropout RNG count
    advanced and train-mode BatchNorm statistics moved."""
    from flax import nnx

    from activity.testing import check

    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.linear = nnx.Linear(3, 2, rngs=rngs)
            self.norm = nnx.BatchNorm(2, rngs=rngs)
            self.dropout = nnx.Dropout(0.3, rngs=rngs)

        def __call__(self, x):
            return self.dropout(self.norm(self.linear(x)))

    model = Net(nnx.Rngs(0, dropout=1))
    model.train()
    _, before = nnx.split(model)
    before = [np.array(jax.random.key_data(leaf) if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key) else leaf) for leaf in jax.tree_util.tree_leaves(before)]
    check(lambda model, x: model(x), Active(model), Constant(normal(10, 4, 3)), operators=["pushforward", "pullback"], directions=1)
    _, after = nnx.split(model)
    after = [np.array(jax.random.key_data(leaf) if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key) else leaf) for leaf in jax.tree_util.tree_leaves(after)]
    assert len(after) == len(before)
    for now, then in zip(after, before):
        np.testing.assert_array_equal(now, then)


# ------------------------------------------------------------------- Flax NNX, prepared


def test_a_strict_prepared_call_names_the_nnx_attribute_that_changed():
    """``model.eval()`` flips static attributes of the graph; the refusal said only that the
    graph differs, which reads as if another model had been passed."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.linear = nnx.Linear(3, 4, rngs=rngs)
            self.dropout = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.dropout(self.linear(x))

    def loss(model, x):
        return jnp.sum(jnp.tanh(model(x)) ** 2)

    model, x = Net(nnx.Rngs(0, dropout=1)), normal(11, 4, 3)
    model.train()
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(x))
    model.eval()
    with pytest.raises(ad.PreparationMismatchError, match=r"its attribute dropout\.deterministic is True, prepared with False"):
        prepared(model, x)
    model.dropout.rate = 0.25
    with pytest.raises(ad.PreparationMismatchError, match=r"dropout\.(deterministic|rate) is (True|0\.25), prepared with (False|0\.5)"):
        prepared(model, x)
    lenient = ad.prepare(ad.gradient, loss, Active(model), Constant(x), strict=False)
    model.train()  # a fresh dropout mask for this count: compared with nnx.grad on a copy
    assert_trees(lenient(model, x), nnx.grad(loss)(nnx.clone(model), x))


# ---------------------------------------------------------------- Equinox masks


def test_an_equinox_filter_spec_is_a_where_mask_and_a_one_argument_filter_is_refused_naming_the_fix():
    """``where=eqx.is_inexact_array`` (the ``eqx.filter_grad`` habit) failed inside the first
    call with Python's bare "takes 1 positional argument but 2 were given"."""
    mlp = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(12))
    x = normal(13, 4, 3)

    def loss(model, x):
        return jnp.sum(jax.vmap(model)(x) ** 2)

    spec = jax.tree_util.tree_map(lambda _: False, mlp)
    spec = eqx.tree_at(lambda m: (m.layers[-1].weight, m.layers[-1].bias), spec, replace=(True, True))
    trained, frozen = eqx.partition(mlp, spec)
    expected = jax.grad(lambda trained: loss(eqx.combine(trained, frozen), x))(trained)
    assert_trees(ad.gradient(loss, Active(mlp, where=spec), Constant(x)), expected)
    with pytest.raises(TypeError, match=r"where=is_inexact_array\).*where=lambda path, leaf: is_inexact_array\(leaf\)"):
        Active(mlp, where=eqx.is_inexact_array)
    with pytest.raises(TypeError, match=r"where=<lambda>\).*where\(path, leaf\)"):
        Active(mlp, where=lambda leaf: True)
    assert_trees(ad.gradient(loss, Active(mlp, where=lambda path, leaf: eqx.is_inexact_array(leaf)), Constant(x)), eqx.filter_grad(loss)(mlp, x))


# ------------------------------------------- new kinds of input the sweep found right


def nnx_state_arrays(module):
    """Every array of an NNX module's state, keys as their raw data."""
    from flax import nnx

    leaves = jax.tree_util.tree_leaves(nnx.split(module)[1])
    return [np.array(jax.random.key_data(leaf) if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key) else leaf) for leaf in leaves]


def assert_same_arrays(now, then):
    assert len(now) == len(then)
    for a, b in zip(now, then):
        np.testing.assert_array_equal(a, b)


def test_an_nnx_transformer_block_with_a_decode_cache_lora_and_dropout_in_an_nnx_jit_train_step():
    import optax
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.attention = nnx.MultiHeadAttention(num_heads=2, in_features=8, qkv_features=8, decode=True, rngs=rngs)
            self.layer_norm, self.rms_norm = nnx.LayerNorm(8, rngs=rngs), nnx.RMSNorm(8, rngs=rngs)
            self.dropout = nnx.Dropout(0.2, rngs=rngs)
            self.mlp = nnx.Sequential(nnx.Linear(8, 16, rngs=rngs), nnx.gelu, nnx.Linear(16, 8, rngs=rngs))
            self.head = nnx.LoRALinear(8, 8, lora_rank=2, rngs=rngs)

        def __call__(self, x):  # two decode steps: the cache variables change inside f
            total = 0.0
            for t in range(2):
                step = x[:, t : t + 1]
                h = step + self.dropout(self.attention(self.layer_norm(step)))
                total = total + jnp.sum(self.head(h + self.mlp(self.rms_norm(h))) ** 2)
            return total

    def loss(model, x):
        return model(x)

    model = Block(nnx.Rngs(params=0, dropout=1))
    model.attention.init_cache((2, 2, 8))
    x, before = normal(14, 2, 2, 8), nnx_state_arrays(model)
    assert_trees(ad.gradient(loss, Active(model), Constant(x)), nnx.grad(loss)(nnx.clone(model), x))
    assert_same_arrays(nnx_state_arrays(model), before)  # cache index, cached keys, dropout count

    twin = nnx.clone(model)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    twin_optimizer = nnx.Optimizer(twin, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
        optimizer.update(model, ad.gradient(loss, Active(model), Constant(x)))

    @nnx.jit
    def twin_step(model, optimizer, x):
        optimizer.update(model, nnx.grad(loss)(nnx.clone(model), x))

    step(model, optimizer, x)
    twin_step(twin, twin_optimizer, x)
    assert_trees(nnx.state(model, nnx.Param), nnx.state(twin, nnx.Param), rtol=1e-5, atol=1e-6)


def test_an_equinox_state_index_counter_as_constant_leaves_the_users_state_usable():
    class Accumulator(eqx.Module):
        index: eqx.nn.StateIndex
        linear: eqx.nn.Linear

        def __init__(self, key):
            self.index, self.linear = eqx.nn.StateIndex(jnp.zeros(3)), eqx.nn.Linear(3, 3, key=key)

        def __call__(self, x, state):
            seen = state.get(self.index)
            return self.linear(x + seen), state.set(self.index, seen + x)

    model, state = eqx.nn.make_with_state(Accumulator)(jax.random.key(15))
    x = normal(16, 3)

    def loss(model, x, state):
        out, state = model(x, state)
        return jnp.sum(out**2), state

    grads, new_state = ad.gradient(loss, Active(model), Constant(x), Constant(state), has_aux=True)
    np.testing.assert_allclose(np.asarray(state.get(model.index)), 0.0)  # still usable: not consumed by the call
    clone = jax.tree_util.tree_unflatten(*reversed(jax.tree_util.tree_flatten(state)))
    expected, expected_state = eqx.filter_grad(loss, has_aux=True)(model, x, clone)
    assert_trees(grads, expected)
    assert_trees(new_state.get(model.index), expected_state.get(model.index))


def test_plain_jax_control_flow_and_a_typed_key_in_an_active_pytree_against_raw_jax_and_finite_differences():
    @jax.custom_jvp
    def softplus(x):
        return jnp.log1p(jnp.exp(x))

    softplus.defjvp(lambda primals, tangents: (softplus(primals[0]), jax.nn.sigmoid(primals[0]) * tangents[0]))

    def loss(tree, x):
        h = jax.checkpoint(lambda w: jnp.sin(w * x))(tree["w"])
        h = jax.lax.cond(jnp.sum(h) > 0, lambda h: 2 * h, lambda h: h - 1, h)
        h = jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h + tree["w"]), h)
        noise = jax.random.normal(tree["key"], h.shape, dtype=jnp.float32)  # the same draw in float64 mode
        return jnp.sum(softplus(h) ** 2 + noise * h) * tree["count"]

    tree = {"w": jnp.linspace(-1.0, 1.0, 4), "key": jax.random.key(17), "count": jnp.array(2)}
    x = normal(18, 4)

    def expected(tree):
        return {"w": jax.grad(lambda w: loss(dict(tree, w=w), x))(tree["w"]), "key": None, "count": None}

    assert_trees(ad.gradient(loss, Active(tree), Constant(x)), expected(tree))
    prepared = ad.prepare(ad.gradient, loss, Active(tree), Constant(x))
    moved = dict(tree, key=jax.random.key(19), count=jnp.array(3))
    assert_trees(prepared(moved, x), expected(moved))
    tangent = {"w": jnp.ones(4), "key": None, "count": None}
    raw_hvp = jax.jvp(lambda w: expected(dict(tree, w=w))["w"], (tree["w"],), (tangent["w"],))[1]
    assert_trees(ad.hvp(loss, Active(tree), Constant(x), tangent=tangent)["w"], raw_hvp, rtol=1e-4, atol=1e-5)
    reference = ad.gradient(loss, Active(tree), Constant(x), backend=ad.AutoFiniteDifferences())
    assert_trees(reference, expected(tree), rtol=2e-3, atol=2e-4)

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

CLOSE = dict(rtol=2e-5, atol=2e-6)


def normal(seed: int, *shape: int) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape)


def assert_trees(actual, expected, **tolerance):
    """Same structure (``None`` positions and container types included), then leaf by leaf."""
    tolerance = tolerance or CLOSE
    assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected), (
        f"{jax.tree_util.tree_structure(actual)}\n!=\n{jax.tree_util.tree_structure(expected)}"
    )
    compared = 0
    for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), err_msg=jax.tree_util.keystr(path), **tolerance)
        compared += 1
    assert compared, "no leaf compared"


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

"""AutoJAX on third-party JAX models and inputs earlier rounds did not cover (round 6): Flax
``struct`` dataclasses, ``jax.experimental.sparse`` BCOO arrays, complex values an NNX module or
a ``where=`` keeps constant, an ``nnx.Param`` holding a Python float, NNX variables named in
preparation messages, ``nnx.bridge``, ``nnx.Param`` metadata and an ``nnx.Optimizer`` as
Constant; Equinox ``filter_vmap`` ensembles, converters, abstract bases, ``filter_checkpoint``;
an optax learning-rate hypergradient and loops with a traced trip count.

Every expected value comes from the model library's own differentiation (``nnx.grad``,
``eqx.filter_grad``, ``jax.grad`` / ``jax.jvp``), never from ``activity``; NNX models' state is
checked unchanged after the calls.
"""

from __future__ import annotations

import abc
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import activity as ad
from activity import Active, Constant

from _sweeps import assert_trees, normal

def nnx_snapshot(module):
    """The values of ``module``'s variables, typed PRNG keys as their raw data (numpy cannot copy a key)."""
    from flax import nnx

    def copied(a):
        return np.asarray(jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a)

    return jax.tree_util.tree_map(copied, nnx.state(module))


# ------------------------------------------------------------ complex values kept constant


def rope_net():
    """A LLaMA-style rotary embedding: its complex ``freqs_cis`` is an ``nnx.Variable``, not a
    Param, so ``nnx.grad`` leaves it alone (its name sorts before the Linear's parameters)."""
    from flax import nnx

    class Rope(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(4, 4, rngs=rngs)
            angles = jnp.arange(3.0)[:, None] * jnp.array([1.0, 0.1])
            self.freqs_cis = nnx.Variable(jnp.exp(1j * angles).astype(jnp.complex64))

        def __call__(self, x):
            h = self.linear(x)
            rotated = (h[:, 0::2] + 1j * h[:, 1::2]) * self.freqs_cis[...]
            return jnp.sum(jnp.real(rotated) ** 2 + jnp.imag(rotated))

    return Rope(nnx.Rngs(0))


def rope_loss(model, x):
    return model(x)


def test_an_nnx_module_with_a_complex_non_param_variable_is_differentiated_in_its_params():
    """The complex buffer was refused as if it were differentiated, and the refusal named
    ``.linear.kernel.value``, a real parameter."""
    from flax import nnx

    model, x, new_x = rope_net(), normal(1, 3, 4), normal(2, 3, 4)
    before = nnx_snapshot(model)
    prepared = ad.prepare(ad.gradient, rope_loss, Active(model), Constant(x))
    assert_trees(prepared(model, x), nnx.grad(rope_loss)(model, x))
    assert_trees(prepared(model, new_x), nnx.grad(rope_loss)(model, new_x))
    reference = ad.gradient(rope_loss, Active(model), Constant(x), backend=ad.AutoFiniteDifferences())
    assert_trees(reference, nnx.grad(rope_loss)(model, x), rtol=1e-3, atol=1e-4)
    assert_trees(nnx_snapshot(model), before, rtol=0, atol=0)


class Phased(eqx.Module):
    weight: jax.Array
    phase: jax.Array  # complex: eqx.filter_grad would differentiate it

    def __call__(self, x):
        return jnp.sum(jnp.abs(self.phase * x) ** 2 + self.weight * x)


def phased_loss(model, x):
    return model(x)


def test_a_complex_leaf_left_out_by_where_is_a_constant_and_refused_where_selected():
    model = Phased(jnp.array([1.0, -0.5]), jnp.array([1 + 1j, 2 - 1j], jnp.complex64))
    x = jnp.array([0.5, 1.5])
    weight_only = Phased(eqx.filter_grad(lambda w, x: phased_loss(Phased(w, model.phase), x))(model.weight, x), None)
    for where in (lambda path, leaf: path == ".weight", Phased(True, False)):
        assert_trees(ad.gradient(phased_loss, Active(model, where=where), Constant(x)), weight_only)
        prepared = ad.prepare(ad.gradient, phased_loss, Active(model, where=where), Constant(x))
        prepared(Active(model, where=where), Constant(x))
        assert_trees(prepared(Active(model, where=where), Constant(2 * x)), Phased(2 * x, None))
    for selecting in (None, lambda path, leaf: True, Phased(False, True)):
        with pytest.raises(ad.UnsupportedError, match=r"argument 0 .*complex value at \.phase;"):
            ad.gradient(phased_loss, Active(model, where=selecting), Constant(x))


def test_preparation_messages_name_the_nnx_variable_that_changed(monkeypatch):
    """An NNX module's leaves are kept parameters first: the messages named the leaf at the
    same index in the module's own order (``.linear.kernel.value``), or "a leaf inside it"."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rows):
            self.linear = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
            self.bias_table = nnx.Variable(jnp.ones((rows, 4)))

        def __call__(self, x):
            return jnp.sum(self.linear(x) * self.bias_table[...][0])

    def loss(model, x):
        return model(x)

    x = normal(3, 2, 4)
    prepared = ad.prepare(ad.gradient, loss, Active(Net(3)), Constant(x))
    with pytest.raises(ad.PreparationMismatchError, match=r"at \.bias_table\.value: expected .* shape \(3, 4\)"):
        prepared(Net(5), x)
    monkeypatch.setattr("activity._preparation.WARN_AFTER", 1)  # warn at the second new signature
    lenient = ad.prepare(ad.gradient, loss, Active(Net(3)), Constant(x), strict=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in (4, 5):
            lenient(Net(rows), x)
    assert any("at .bias_table.value: shape (4, 4) -> (5, 4)" in str(w.message) for w in caught), caught
    last = Net(5)
    assert_trees(lenient(last, 2 * x), nnx.grad(loss)(last, 2 * x))


def test_an_nnx_param_holding_a_python_float_is_differentiated_as_nnx_grad_does():
    """``nnx.Param(2.0)`` got None, taken for a static hyper-parameter (a Python float elsewhere
    in a pytree, or an Equinox float field, is one); ``nnx.grad`` differentiates it."""
    from flax import nnx

    class Scaled(nnx.Module):
        def __init__(self, scale):
            self.scale = nnx.Param(scale)
            self.weight = nnx.Param(jnp.array([1.0, -0.5, 0.25]))
            self.calls = nnx.Variable(3)  # an int that is no Param: still not differentiated

        def __call__(self, x):
            return jnp.sum(jnp.tanh(self.weight[...] * x)) * self.scale.get_value() ** 2

    def loss(model, x):
        return model(x)

    model, x = Scaled(2.0), normal(19, 3)
    grads = ad.gradient(loss, Active(model), Constant(x))
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(x))
    prepared(model, x)
    again = prepared(Scaled(3.0), x + 1)
    in_a_dict = ad.gradient(lambda d, x: loss(d["model"], x) * d["weight"], Active({"model": model, "weight": 0.5}), Constant(x))
    assert type(model.scale.get_value()) is float and model.scale.get_value() == 2.0  # (nnx.grad leaves a jax TypedFloat there)
    assert_trees(grads, nnx.grad(loss)(nnx.clone(model), x))
    assert_trees(again, nnx.grad(loss)(Scaled(3.0), x + 1))
    assert in_a_dict["weight"] is None  # a Python float outside the module stays a hyper-parameter
    assert_trees(in_a_dict["model"], nnx.grad(lambda m, x: loss(m, x) * 0.5)(nnx.clone(model), x))


# ------------------------------------------------------------------------ Flax and sparse


def test_flax_struct_dataclass_with_static_fields_and_a_changed_static_named():
    from flax import struct

    @struct.dataclass
    class Layer:
        weight: jax.Array
        bias: jax.Array
        activation: str = struct.field(pytree_node=False, default="tanh")

    def loss(layer, x):
        act = jnp.tanh if layer.activation == "tanh" else jax.nn.relu
        return jnp.sum(act(x @ layer.weight + layer.bias) ** 2)

    layer, x = Layer(normal(4, 3, 2), normal(5, 2)), normal(6, 4, 3)
    grads = ad.gradient(loss, Active(layer), Constant(x))
    assert type(grads) is Layer and grads.activation == "tanh"
    assert_trees(grads, jax.grad(loss)(layer, x))
    prepared = ad.prepare(ad.gradient, loss, Active(layer), Constant(x))
    prepared(layer, x)
    moved = layer.replace(weight=2 * layer.weight)
    assert_trees(prepared(moved, x + 1), jax.grad(loss)(moved, x + 1))
    with pytest.raises(ad.PreparationMismatchError, match=r"argument 0 .*static data of a node differs"):
        prepared(layer.replace(activation="relu"), x)


def test_a_bcoo_sparse_matrix_as_constant_and_as_active_like_eqx_filter_grad():
    from jax.experimental import sparse

    def loss(v, matrix):
        return jnp.sum((matrix @ v) ** 2)

    matrix = sparse.BCOO.fromdense(jnp.array([[1.0, 0, 2], [0, 3, 0]]))
    other = sparse.BCOO.fromdense(jnp.array([[0.0, 1, 2], [0, 0, 5]]))  # the same number of entries
    v = jnp.array([1.0, 2.0, 3.0])
    expected = jax.jit(jax.grad(loss))
    assert_trees(ad.gradient(loss, Active(v), Constant(matrix)), expected(v, matrix))
    prepared = ad.prepare(ad.gradient, loss, Active(v), Constant(matrix))
    prepared(v, matrix)
    assert_trees(prepared(2 * v, other), expected(2 * v, other))
    # Active: its float data differentiated, its int indices None, as eqx.filter_grad does
    grads = ad.gradient(lambda m, v: loss(v, m), Active(matrix), Constant(v))
    dense = jax.jit(jax.grad(lambda m, v: loss(v, m)))(matrix.todense(), v)
    assert grads.indices is None
    np.testing.assert_allclose(grads.data, dense[tuple(matrix.indices.T)], rtol=1e-6)


def test_nnx_bridge_param_metadata_and_an_optimizer_as_constant():
    import flax.linen as nn
    from flax import nnx
    from flax.nnx import bridge

    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(x)

    class Model(nnx.Module):
        def __init__(self, x):
            self.scale = nnx.Param(jnp.full((3,), 0.5), description="per-feature scale")
            self.linen = bridge.ToNNX(Dense(), rngs=nnx.Rngs(0))
            bridge.lazy_init(self.linen, x)

        def __call__(self, x):
            return self.linen(x * self.scale[...])

    def loss(model, x, optimizer):
        return jnp.sum(jnp.tanh(model(x)) ** 2) * (1.0 + optimizer.step[...])

    x, new_x = normal(7, 4, 3), normal(8, 4, 3)
    model = Model(x)
    twin = nnx.clone(model)
    optimizer = nnx.Optimizer(twin, optax.adam(1e-2), wrt=nnx.Param)
    before = nnx_snapshot(model)
    grads = ad.gradient(loss, Active(model), Constant(x), Constant(optimizer))
    assert grads["scale"].get_metadata()["description"] == "per-feature scale"
    # nnx.grad on clones: the bridge draws from its rngs on every call, and nnx.grad counts them
    assert_trees(grads, nnx.grad(loss)(nnx.clone(model), x, optimizer))
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(x), Constant(optimizer))
    prepared(model, x, optimizer)
    optimizer.update(twin, grads)  # the user's step with the result: a new step count for the prepared call
    assert int(optimizer.step[...]) == 1
    assert_trees(prepared(model, new_x, optimizer), nnx.grad(loss)(nnx.clone(model), new_x, optimizer))
    assert_trees(nnx_snapshot(model), before, rtol=0, atol=0)  # activity left the rng count as it was


# ------------------------------------------------------------------------------- Equinox


def test_an_equinox_ensemble_made_by_filter_vmap_and_an_abstract_base_with_converters():
    ensemble = eqx.filter_vmap(lambda key: eqx.nn.Linear(3, 2, key=key))(jax.random.split(jax.random.key(1), 3))
    x = normal(10, 5, 3)

    def spread(models, x):
        return jnp.mean(eqx.filter_vmap(lambda m: jax.vmap(m)(x))(models) ** 2)

    prepared = ad.prepare(ad.value_and_gradient, spread, Active(ensemble), Constant(x))
    prepared(ensemble, x)
    value, grads = prepared(ensemble, x + 1)
    expected_value, expected = eqx.filter_value_and_grad(spread)(ensemble, x + 1)
    np.testing.assert_allclose(value, expected_value, rtol=1e-6)
    assert_trees(grads, expected)

    class Base(eqx.Module):
        scale: eqx.AbstractVar[jax.Array]

        @abc.abstractmethod
        def __call__(self, x): ...

    class Converted(Base):
        weight: jax.Array = eqx.field(converter=jnp.asarray)
        scale: jax.Array = eqx.field(converter=lambda s: jnp.asarray(s, jnp.float32))

        def __call__(self, x):
            return jnp.sum(jnp.sin(self.weight * x) * self.scale)

    converted = Converted([1.0, 2.0, 3.0], 2)

    def call(model, x):
        return eqx.filter_checkpoint(lambda m, x: m(x))(model, x)

    assert_trees(ad.gradient(call, Active(converted), Constant(x[0])), eqx.filter_grad(call)(converted, x[0]))


# ---------------------------------------------------------------------------- plain JAX


def test_an_optax_learning_rate_hypergradient_through_an_adam_step():
    params = {"w": normal(11, 3), "b": jnp.array(0.1)}
    X, Y = normal(12, 6, 3), jnp.arange(6.0)

    def fit(p, X, Y):
        return jnp.mean((X @ p["w"] + p["b"] - Y) ** 2)

    def after_a_step(lr, params, X, Y):
        optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=lr)
        updates, _ = optimizer.update(jax.grad(fit)(params, X, Y), optimizer.init(params), params)
        return fit(optax.apply_updates(params, updates), X, Y)

    lr = jnp.array(0.05)
    prepared = ad.prepare(ad.gradient, after_a_step, Active(lr), Constant(params), Constant(X), Constant(Y))
    prepared(lr, params, X, Y)
    assert_trees(prepared(2 * lr, params, 2 * X, Y), jax.grad(after_a_step)(2 * lr, params, 2 * X, Y))


def test_a_loop_with_a_traced_trip_count_forward_right_reverse_a_clear_error():
    def repeated(x, n):
        return jax.lax.fori_loop(0, n, lambda i, c: jnp.sin(c) * 1.1, x)

    x, tangent = normal(13, 3), normal(14, 3)
    pushforward = ad.prepare(ad.pushforward, repeated, Active(x), Constant(jnp.array(3)), tangent=tangent)
    pushforward(x, jnp.array(3), tangent=tangent)
    expected = jax.jvp(lambda x: repeated(x, 5), (x,), (tangent,))[1]
    assert_trees(pushforward(x, jnp.array(5), tangent=tangent), expected)
    gradient = ad.prepare(ad.gradient, lambda x, n: jnp.sum(repeated(x, n)), Active(x), Constant(jnp.array(3)))
    with pytest.raises(ValueError, match="Reverse-mode differentiation does not work for lax.while_loop") as refused:
        gradient(x, jnp.array(3))
    # JAX refuses after f has run: the note says which operator, and what works instead
    (note,) = [note for note in getattr(refused.value, "__notes__", []) if "activity." in note]
    assert note.startswith("(raised by JAX when activity.gradient on AutoJAX() differentiated f in reverse mode)")
    assert "activity.pushforward" in note and "Python int, Constant(n), is static" in note
    hvp = ad.prepare(ad.hvp, lambda x, n: jnp.sum(repeated(x, n)), Active(x), Constant(jnp.array(3)), tangent=tangent)
    with pytest.raises(ValueError, match="while_loop") as refused:
        hvp(x, jnp.array(3), tangent=tangent)
    assert sum("activity.hvp on AutoJAX()" in note for note in refused.value.__notes__) == 1
    # a Python int is static: reverse mode then unrolls a scan, as jax.grad does
    expected = jax.grad(lambda x: jnp.sum(repeated(x, 4)))(x)
    assert_trees(ad.gradient(lambda x, n: jnp.sum(repeated(x, n)), Active(x), Constant(4)), expected)

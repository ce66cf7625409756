"""AutoJAX on third-party JAX models and inputs earlier rounds did not cover (round 5): Equinox
rotary embeddings, circular padding, non-array and static fields edited with
``eqx.tree_at`` between prepared calls; Flax NNX custom ``Variable`` types, train/eval modes,
``nnx.jit`` losses, ``nnx.List``, LoRA, an NNX module as Cache; Linen ``Partitioned`` boxes with
``batch_stats`` and ``nn.scan(nn.remat(...))``; Haiku state; pytrees with
None, empty containers, namedtuples, custom nodes, bool / key / float16 / bfloat16 leaves,
pytree outputs, x64 mode and key constants.

Every expected value comes from the model library's own differentiation (``nnx.grad``,
``eqx.filter_grad``, ``jax.grad`` / ``jax.jvp`` / ``jax.vjp``), never from ``activity``; every
NNX model's state (values, RNG counts, batch statistics) is checked unchanged after the calls.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import activity as ad
from activity import Active, Cache, Constant

from _sweeps import assert_trees, normal

LOOSE = dict(rtol=1e-4, atol=1e-5)
HALF = dict(rtol=1e-2, atol=1e-2)


def without_keys(tree):
    """``tree`` with typed PRNG keys as their raw data: numpy cannot copy a typed key."""
    return jax.tree_util.tree_map(
        lambda a: np.asarray(jax.random.key_data(a)) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else np.asarray(a), tree
    )


def nnx_snapshot(module):
    from flax import nnx

    return without_keys(nnx.state(module))


# ------------------------------------------------------------------------------- Equinox


def test_equinox_rotary_embeddings_as_a_constant_of_a_prepared_call_and_refused_as_active():
    query, new_query = normal(1, 3, 8), normal(3, 3, 8)
    rope = eqx.nn.RotaryPositionalEmbedding(8)  # no floating leaf: a Constant, refused as Active

    def rotated(x, rope):
        return jnp.sum(jnp.sin(rope(x)))

    prepared = ad.prepare(ad.gradient, rotated, Active(query), Constant(rope))
    prepared(query, rope)
    assert_trees(prepared(new_query, rope), jax.grad(rotated)(new_query, rope))
    with pytest.raises(TypeError, match=r"argument 1 .*no floating-point value.*Constant"):
        ad.gradient(rotated, Active(query), Active(rope))


def test_equinox_conv_circular_padding_gradient_and_hvp():
    mode = "CIRCULAR"
    conv = eqx.nn.Conv1d(2, 3, 3, padding=1, padding_mode=mode, key=jax.random.key(0))
    x, direction = normal(1, 2, 7), normal(2, 2, 7)

    def loss(model, x):
        return jnp.sum(model(x) ** 3)

    assert_trees(ad.gradient(loss, Active(conv), Constant(x)), eqx.filter_grad(loss)(conv, x))
    expected_hvp = jax.jvp(lambda x: jax.grad(loss, 1)(conv, x), (x,), (direction,))[1]
    assert_trees(ad.hvp(loss, Constant(conv), Active(x), tangent=direction), expected_hvp, **LOOSE)


class Fields(eqx.Module):
    weight: jax.Array
    activation: object  # a function: static, as eqx.filter_grad treats it
    depth: int
    name: str
    bias: np.ndarray  # a numpy array: differentiated, as eqx.filter_grad does
    shift: jax.tree_util.Partial  # a pytree holding an array

    def __call__(self, x):
        y = x @ self.weight + self.bias
        for _ in range(self.depth):
            y = self.activation(y)
        return jnp.sum(self.shift(y) ** 2)


def test_equinox_non_array_fields_and_models_edited_with_tree_at_between_prepared_calls():
    model = Fields(
        normal(1, 3, 2), jax.nn.gelu, 2, "net", np.array([0.5, -0.2], np.float32),
        jax.tree_util.Partial(lambda c, y: jnp.sin(c * y), normal(2, 2)),
    )
    x = normal(3, 4, 3)

    def loss(model, x):
        return model(x)

    assert_trees(ad.gradient(loss, Active(model), Constant(x)), eqx.filter_grad(loss)(model, x))
    assert isinstance(model.bias, np.ndarray)
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(x))
    prepared(model, x)
    for edited in (
        eqx.tree_at(lambda m: m.bias, model, np.array([1.5, 0.2], np.float32)),
        eqx.tree_at(lambda m: m.weight, model, normal(4, 3, 2)),
        eqx.tree_at(lambda m: m.shift.args[0], model, normal(5, 2)),
    ):
        assert_trees(prepared(edited, x), eqx.filter_grad(loss)(edited, x))
    tanh_model = eqx.tree_at(lambda m: m.activation, model, jnp.tanh)
    with pytest.raises(ad.PreparationMismatchError, match=r"argument 0 .* at \.activation: expected the value <function gelu"):
        prepared(tanh_model, x)
    lenient = ad.prepare(ad.gradient, loss, Active(model), Constant(x), strict=False)
    lenient(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # re-preparing may warn
        assert_trees(lenient(tanh_model, x), eqx.filter_grad(loss)(tanh_model, x))


with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Equinox warns of a static array field, and runs it

    class StaticArray(eqx.Module):
        weight: jax.Array
        scale: jax.Array = eqx.field(static=True)

        def __call__(self, x):
            return jnp.sum((x @ self.weight) * self.scale) ** 2

    def static_array_model(scale):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return StaticArray(normal(1, 3, 2), jnp.asarray(scale))


def test_an_equinox_static_array_field_prepares_and_a_changed_one_is_named_or_re_prepared():
    """Every prepared call crashed with JAX's "Exception raised while checking equality of metadata
    fields of pytree" (its treedef comparison cannot compare an array), even with the prepared model."""
    model, x = static_array_model([1.0, 2.0]), normal(2, 4, 3)

    def loss(model, x):
        return model(x)

    def check(result, model, x=x):  # treedefs with an array inside do not compare: leaf by leaf
        np.testing.assert_allclose(result.weight, eqx.filter_grad(loss)(model, x).weight, rtol=2e-5)
        np.testing.assert_array_equal(result.scale, model.scale)

    check(ad.gradient(loss, Active(model), Constant(x)), model)
    strict = ad.prepare(ad.gradient, loss, Active(model), Constant(x))
    check(strict(model, x), model)
    equal = static_array_model([1.0, 2.0])  # an equal array: the same signature
    check(strict(equal, 2 * x), equal, 2 * x)
    changed = static_array_model([3.0, -1.0])
    with pytest.raises(ad.PreparationMismatchError, match=r"argument 0 .*the static data of a node differs .*static=True"):
        strict(changed, x)
    lenient = ad.prepare(ad.gradient, loss, Active(model), Constant(x), strict=False)
    check(lenient(model, x), model)
    check(lenient(changed, x), changed)


# ------------------------------------------------------------------------------- Flax NNX


def nnx_net(dropout=0.5):
    from flax import nnx

    class Scale(nnx.Variable):  # a custom Variable: not a parameter
        pass

    class Tuned(nnx.Param):  # a Param subclass: a parameter, as nnx.grad's filter says
        pass

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(3, 4, rngs=rngs)
            self.norm = nnx.BatchNorm(4, rngs=rngs)
            self.drop = nnx.Dropout(dropout, rngs=rngs)
            self.blocks = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(2)])
            self.scale = Scale(jnp.array(1.5))
            self.tuned = Tuned(jnp.array([0.3, -0.2, 0.1, 0.4]))

        def __call__(self, x):
            y = self.norm(self.linear(x)) * self.scale[...] + self.tuned[...]
            for block in self.blocks:
                y = jnp.tanh(block(y))
            return jnp.sum(self.drop(y) ** 2)

    return Net(nnx.Rngs(0, dropout=1))


def nnx_loss(model, x):
    return model(x)


def nnx_expected(model, x):
    from flax import nnx

    return nnx.grad(nnx_loss)(nnx.clone(model), x)


def test_nnx_custom_variable_types_dropout_and_batch_norm_before_and_after_the_users_own_steps():
    from flax import nnx

    model, x = nnx_net(), normal(2, 5, 3)
    before = nnx_snapshot(model)
    result = ad.gradient(nnx_loss, Active(model), Constant(x))
    assert_trees(nnx_snapshot(model), before, rtol=0, atol=0)
    assert_trees(result, nnx_expected(model, x))
    assert "scale" not in result and "tuned" in result

    @nnx.jit
    def jitted_loss(model, x):
        return model(x)

    prepared = ad.prepare(ad.gradient, jitted_loss, Active(model), Constant(x))
    for step in range(2):
        data = normal(10 + step, 5, 3)
        before = nnx_snapshot(model)
        assert_trees(prepared(model, data), nnx_expected(model, data))
        assert_trees(nnx_snapshot(model), before, rtol=0, atol=0)
        model(data)  # the user's own step: a new dropout count, new batch statistics


def test_nnx_train_mode_hvp_pushforward_and_pullback_against_jax_on_a_pure_function():
    from flax import nnx

    model, x = nnx_net(dropout=0.2), normal(2, 5, 3)
    params = nnx.state(model, nnx.Param)
    tangent = jax.tree_util.tree_map(jnp.ones_like, params)

    def pure(params):
        copy = nnx.clone(model)
        nnx.update(copy, params)
        return copy(x)

    before = nnx_snapshot(model)
    expected_hvp = jax.jvp(jax.grad(pure), (params,), (tangent,))[1]
    assert_trees(ad.hvp(nnx_loss, Active(model), Constant(x), tangent=tangent), expected_hvp, **LOOSE)
    expected_jvp = jax.jvp(pure, (params,), (tangent,))[1]
    np.testing.assert_allclose(ad.pushforward(nnx_loss, Active(model), Constant(x), tangent=tangent), expected_jvp, rtol=1e-5)
    doubled = jax.tree_util.tree_map(lambda g: 2 * g, jax.grad(pure)(params))
    assert_trees(ad.pullback(nnx_loss, Active(model), Constant(x), cotangent=jnp.array(2.0)), doubled)
    assert_trees(nnx_snapshot(model), before, rtol=0, atol=0)


def test_nnx_lora_gradient_and_a_where_on_its_paths():
    from flax import nnx

    lora = nnx.LoRA(3, 2, 4, base_module=nnx.Linear(3, 4, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1))
    x = normal(2, 5, 3)

    def loss(model, x):
        return jnp.sum(jnp.sin(model(x)))

    assert_trees(ad.gradient(loss, Active(lora), Constant(x)), nnx.grad(loss)(lora, x))
    only_lora = ad.gradient(loss, Active(lora, where=lambda path, leaf: "lora" in path), Constant(x))
    expected = nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(lora, x)
    assert_trees({k: only_lora[k] for k in ("lora_a", "lora_b")}, {k: expected[k] for k in ("lora_a", "lora_b")})
    assert only_lora["base_module"]["kernel"].value is None



def test_an_nnx_module_as_cache_carries_derivatives_through_its_variable():
    from flax import nnx

    class Buffer(nnx.Module):
        def __init__(self):
            self.buf = nnx.Cache(jnp.zeros(4))

    class Weights(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(normal(3, 4))

    def f(model, cache, x):
        cache.buf.value = jnp.tanh(model.w.value * x)
        return jnp.sum(cache.buf.value**2)

    def expected(model, x):
        return nnx.grad(lambda m: jnp.sum(jnp.tanh(m.w.value * x) ** 2))(model)

    model, cache, x = Weights(), Buffer(), normal(4, 4)
    assert_trees(ad.gradient(f, Active(model), Cache(cache), Constant(x)), expected(model, x))
    prepared = ad.prepare(ad.gradient, f, Active(model), Cache(cache), Constant(x))
    prepared(model, cache, x)
    assert_trees(prepared(model, cache, 2 * x), expected(model, 2 * x))


# ---------------------------------------------------------------------- Linen, Haiku, Optax


def test_linen_partitioned_params_with_batch_stats_as_mutable_aux_and_a_where_prefix():
    from flax import linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
            x = nn.BatchNorm(use_running_average=not train)(nn.Dense(4, kernel_init=init)(x))
            return jnp.tanh(x)

    net, x = Net(), normal(1, 6, 3)
    variables = net.init(jax.random.key(0), x, False)

    def loss(params, batch_stats, x):
        y, updates = net.apply({"params": params, "batch_stats": batch_stats}, x, True, mutable=["batch_stats"])
        return jnp.sum(y**2), updates

    params, stats = variables["params"], variables["batch_stats"]
    result, updates = ad.gradient(loss, Active(params), Constant(stats), Constant(x), has_aux=True)
    expected, expected_updates = jax.grad(loss, has_aux=True)(params, stats, x)
    assert_trees(result, expected)  # the Partitioned box and its names included
    assert_trees(updates, expected_updates)
    prepared = ad.prepare(ad.gradient, loss, Active(params), Constant(stats), Constant(x), has_aux=True)
    prepared(params, stats, x)
    new_stats, new_x = expected_updates["batch_stats"], normal(2, 6, 3)
    assert_trees(prepared(params, new_stats, new_x), jax.grad(loss, has_aux=True)(params, new_stats, new_x))

    def evaluated(variables, x):
        return jnp.sum(net.apply(variables, x, False) ** 2)

    masked = ad.gradient(evaluated, Active(variables, where={"params": True, "batch_stats": False}), Constant(x))
    assert_trees(masked["params"], jax.grad(evaluated)(variables, x)["params"])
    assert jax.tree_util.tree_leaves(masked["batch_stats"]) == []


def test_linen_scan_of_remat_layers_prepared_value_and_gradient():
    from flax import linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, carry, _):
            return jnp.tanh(nn.Dense(3)(carry)), None

    class Scanned(nn.Module):
        @nn.compact
        def __call__(self, x):
            layers = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
            return layers()(x, None)[0]

    model, x = Scanned(), normal(1, 2, 3)
    variables = model.init(jax.random.key(0), x)

    def loss(variables, x):
        return jnp.sum(model.apply(variables, x) ** 2)

    prepared = ad.prepare(ad.value_and_gradient, loss, Active(variables), Constant(x))
    prepared(variables, x)
    value, gradient = prepared(variables, 2 * x)
    np.testing.assert_allclose(value, loss(variables, 2 * x), rtol=1e-6)
    assert_trees(gradient, jax.grad(loss)(variables, 2 * x))


def test_haiku_batch_norm_state_as_a_constant_and_its_update_as_aux():
    import haiku as hk

    def forward(x, is_training):
        x = hk.BatchNorm(True, True, 0.9)(hk.Linear(4)(x), is_training)
        return jnp.sum(jnp.tanh(x) ** 2)

    transformed = hk.transform_with_state(forward)
    x = normal(1, 5, 3)
    params, state = transformed.init(jax.random.key(0), x, True)

    def loss(params, state, x):
        return transformed.apply(params, state, None, x, True)

    state_before = without_keys(state)
    prepared = ad.prepare(ad.gradient, loss, Active(params), Constant(state), Constant(x), has_aux=True)
    result, new_state = prepared(params, state, x)
    expected, expected_state = jax.grad(loss, has_aux=True)(params, state, x)
    assert_trees(result, expected)
    assert_trees(new_state, expected_state)
    assert_trees(without_keys(state), state_before, rtol=0, atol=0)
    assert_trees(prepared(params, new_state, 2 * x), jax.grad(loss, has_aux=True)(params, expected_state, 2 * x))


# ----------------------------------------------------------------------------------- pytrees

Pair = collections.namedtuple("Pair", "a b")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["w", "n"], meta_fields=["tag"])
@dataclasses.dataclass
class Record:
    w: jax.Array
    n: jax.Array  # an int array
    tag: str


class Keyed:
    def __init__(self, u, mask):
        self.u, self.mask = u, mask


jax.tree_util.register_pytree_with_keys(
    Keyed,
    lambda k: (((jax.tree_util.GetAttrKey("u"), k.u), (jax.tree_util.GetAttrKey("mask"), k.mask)), None),
    lambda _, children: Keyed(*children),
    flatten_func=lambda k: ((k.u, k.mask), None),
)


def wild_tree(seed):
    return {
        "none": None, "empty": (), "empty_dict": {},
        "pair": Pair(normal(seed, 3), normal(seed + 1, 2)),
        "record": Record(normal(seed + 2, 2, 2), jnp.array(3), "t"),
        "keyed": Keyed(normal(seed + 3, 3), jnp.array([True, False, True])),
        "key": jax.random.key(seed + 4),
        "half": normal(seed + 5, 3).astype(jnp.float16), "brain": normal(seed + 6, 2).astype(jnp.bfloat16),
    }


def wild_f(t):
    s = jnp.sum(jnp.sin(t["pair"].a) * 2.0) + jnp.sum(t["pair"].b ** 3)
    s = s + jnp.sum(t["record"].w @ t["record"].w) * t["record"].n
    s = s + jnp.sum(jnp.where(t["keyed"].mask, t["keyed"].u ** 2, 0.0))
    s = s + jnp.sum(jax.random.normal(t["key"], (3,)) * t["keyed"].u)
    return s + jnp.sum(t["half"].astype(jnp.float32) ** 2) + jnp.sum(t["brain"].astype(jnp.float32) * 3)


def test_a_wild_pytree_in_gradient_prepared_and_under_a_jitted_f():
    tree = wild_tree(1)
    expected = eqx.filter_grad(wild_f)(tree)
    result = ad.gradient(wild_f, Active(tree))
    assert_trees(result, expected, **HALF)
    assert result["half"].dtype == jnp.float16 and result["brain"].dtype == jnp.bfloat16
    assert_trees(ad.gradient(jax.jit(wild_f), Active(tree)), expected, **HALF)
    prepared = ad.prepare(ad.gradient, wild_f, Active(tree))
    prepared(tree)
    assert_trees(prepared(wild_tree(20)), eqx.filter_grad(wild_f)(wild_tree(20)), **HALF)



def test_pytree_outputs_in_jacobian_and_pullback():
    def f(x, y):
        return {"s": jnp.sum(x) * y, "v": Pair(x * 2, jnp.outer(x, y)), "n": None}

    x, y = normal(1, 3), normal(2, 2)
    assert_trees(ad.jacobian(f, Active(x), Constant(y)), jax.jacobian(f)(x, y))
    cotangent = {"s": normal(3, 2), "v": Pair(normal(4, 3), normal(5, 3, 2)), "n": None}
    assert_trees(ad.pullback(f, Active(x), Constant(y), cotangent=cotangent), jax.vjp(lambda x: f(x, y), x)[1](cotangent)[0])
    with pytest.raises(TypeError, match=r"dtype int32 at \['i'\]"):
        ad.jacobian(lambda x: {"s": x * 2, "i": jnp.array(3)}, Active(x))



def test_float16_and_bfloat16_hvp_unprepared_and_prepared():
    def f(t):
        half = t["half"].astype(jnp.float32)
        return jnp.sum(half**3) + jnp.sum(jnp.sin(t["brain"].astype(jnp.float32)) * half[:2])

    def tree(seed):
        return {"half": normal(seed, 3).astype(jnp.float16), "brain": normal(seed + 1, 2).astype(jnp.bfloat16)}

    t, tangent = tree(1), {"half": jnp.ones(3, jnp.float16), "brain": jnp.ones(2, jnp.bfloat16)}
    result = ad.hvp(f, Active(t), tangent=tangent)
    assert result["half"].dtype == jnp.float16 and result["brain"].dtype == jnp.bfloat16
    assert_trees(result, jax.jvp(jax.grad(f), (t,), (tangent,))[1], **HALF)
    prepared = ad.prepare(ad.hvp, f, Active(t), tangent=tangent)
    prepared(t, tangent=tangent)
    assert_trees(prepared(tree(5), tangent=tangent), jax.jvp(jax.grad(f), (tree(5),), (tangent,))[1], **HALF)


def test_x64_mode_gradients_and_a_float32_preparation_refusing_float64():
    def f(x, c):
        return jnp.sum(jnp.sin(x) * c)

    x, c = normal(1, 3), normal(2, 3)
    prepared = ad.prepare(ad.gradient, f, Active(x), Constant(c))
    with jax.enable_x64(True):
        wide = jnp.asarray(np.asarray(x), dtype=jnp.float64)
        result = ad.gradient(f, Active(wide), Constant(c))
        assert result.dtype == jnp.float64
        np.testing.assert_allclose(result, jax.grad(f)(wide, c), rtol=1e-12)
        with pytest.raises(ad.PreparationMismatchError, match=r"dtype float32, got .* dtype float64"):
            prepared(wide, c)
    np.testing.assert_allclose(prepared(x, c), jax.grad(f)(x, c), rtol=1e-6)


def test_typed_and_raw_keys_as_constants_draw_anew_in_prepared_calls():
    def f(x, key, raw):
        return jnp.sum(x * jax.random.normal(key, x.shape)) + jnp.sum(x**2 * jax.random.uniform(raw, x.shape))

    x = normal(1, 4)
    prepared = ad.prepare(ad.gradient, f, Active(x), Constant(jax.random.key(0)), Constant(jax.random.PRNGKey(0)))
    for seed in range(3):
        key, raw = jax.random.key(seed + 10), jax.random.PRNGKey(seed + 20)
        assert_trees(prepared(x, key, raw), jax.grad(f)(x, key, raw))

    def draws(x, key):
        return x * jax.random.normal(key, x.shape)

    jacobian = ad.prepare(ad.jacobian, draws, Active(x), Constant(jax.random.key(0)))
    for seed in range(2):
        key = jax.random.key(seed + 3)
        assert_trees(jacobian(x, key), jax.jacobian(draws)(x, key))

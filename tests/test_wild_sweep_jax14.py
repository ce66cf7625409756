"""AutoJAX on the libraries users bring (round 14): NNX graph objects that are not modules (a
user's ``nnx.Pytree`` subclass, an ``nnx.Object``, ``nnx.Rngs`` inside an Active pytree, an
``nnx.Optimizer`` stepped inside f for a MAML loss), NNX ``sow`` intermediates popped in f;
Linen ``sow`` with BatchNorm and Dropout under ``mutable=[...]``; Haiku ``transform_with_state``
with ``hk.BatchNorm`` and dropout; Equinox ``SpectralNorm`` (an ``eqx.nn.State``),
``WeightNorm`` and ``MultiheadAttention`` with rotary embeddings through ``process_heads``.

Before this round an NNX graph object other than an ``nnx.Module`` was read as a plain pytree:
an Active ``nnx.Pytree`` had its ``BatchStat`` differentiated and came back as itself holding
gradients (``nnx.grad`` gives the ``nnx.State`` of its Params), an ``nnx.Object`` (not a pytree)
was a static leaf (refused as Active, a mismatch for a new one in a prepared call), and an
``nnx.Rngs`` inside an Active pytree came back as an Rngs of ``None`` where ``nnx.grad`` gives an
empty State. NNX's convention now holds for every ``nnx.Pytree``. The testing kit's ``check``
failed a right bfloat16 / float16 gradient: ``<gradient, u>`` was reduced to float64 before the
comparison and held to float64's rounding (the same model's pushforward passed); it now allows
the dtype's rounding and still catches a gradient 50% off. The kit's intact check saw an
``nnx.Object`` argument as one opaque leaf: a write to its variables went unseen. ``test_differentiation`` held every
half-precision scenario to atol 1e-5 although ``Scenario`` documents its default tolerance as
"from the dtypes": every operator failed; the default now allows the dtype's rounding, as
``check`` does (a tolerance set by hand is used as given).

Expected values come from ``nnx.grad`` / ``nnx.value_and_grad``, ``eqx.filter_grad`` and
``jax.grad`` / ``jax.jvp`` / ``jax.jacobian`` written out here, never from ``activity``; the user's
objects (NNX state with RNG counts and optimiser moments, Linen/Haiku variables, Equinox state)
are checked unchanged.

Also tried and fine, not kept: the testing kit (``check``, ``test_differentiation`` with
``constantify`` / ``cachify`` / ``closurify`` / ``batchify``) on an NNX model with BatchNorm and
LayerNorm in train and eval mode, on a Linen ``Sequential`` and on an Equinox BatchNorm with
its State (a dropout mask drawn at JAX's default dtype is reported as an unreliable reference,
as it should; ``check`` of a small NNX model takes a minute of finite differences); ``bfloat16``
NNX Linear layers (gradient in bfloat16) and bfloat16 / float16 jacobians, hessians, pullbacks;
complex Constants and an FFT of a real Active (a complex Active is refused, naming it); Linen
``nn.scan(nn.remat(...))`` with a ``dots_with_no_batch_dims_saveable`` policy under prepared
hvp; ``jax.custom_batching.custom_vmap`` under batched tangents; an ``eqx.filter_vmap`` ensemble
(pullback, batched hvp); ``eqx.nn.PReLU`` in a Sequential (also by finite differences); a
dict of loose ``nnx.Param`` / ``nnx.BatchStat`` variables (both differentiated, as ``nnx.grad``
does); every operator under ``jax.numpy_dtype_promotion('strict')``,
``jax.numpy_rank_promotion('raise')``, ``jax.debug_nans``, ``jax.checking_leaks`` and
``jax.disable_jit`` (``transfer_guard('disallow')`` refuses the unprepared calls, which run
eagerly as raw ``jax.grad`` does and fails the same way; prepared calls pass). NNX's
experimental ``hijax`` and ``ref`` variables fail under raw ``nnx.grad`` too, not kept. Also: NNX
layers stacked by ``nnx.vmap`` + ``split_rngs`` and run by ``nnx.scan`` with dropout (prepared,
``where=`` on the head, the mismatch after ``eval()`` naming ``deterministic``, hvp); an
``nnx.MultiMetric`` updated inside f as a Constant; Linen ``nn.remat(static_argnums=...)`` and
``nn.jit`` blocks with ``capture_intermediates`` (hvp), a ``cache`` collection, a Dense applied
twice (hessian); Haiku ``data_structures.partition`` / ``merge`` in f, ``where=`` on Haiku params,
``hk.MultiHeadAttention`` prepared hvp; an ``eqx.nn.State`` as Active (gradient, hvp); optax
losses (integer-label softmax cross-entropy, sigmoid focal, Huber, hinge, KL, ``safe_norm``,
``tree_l2_norm``) and ``jax.nn.relu`` at its kink under gradient, hvp, pushforward and prepared
calls; a BCOO Constant given a new sparsity with another ``nse`` (lenient: re-prepared, right;
strict: a mismatch, kept below: its path read ``[<flat index 0>]``, JAX's name for a child of a
node registered without keys, and now names the attribute, ``.data``) and a ``sparsify``'d hessian; ``jax.config`` unchanged after finite
differences, ``check`` and ``test_differentiation`` with x64 on, off, and strict promotion.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import activity as ad
from activity import Active, Constant

from _sweeps import assert_same_state, assert_trees, nnx_snapshot, normal, untouched

pytest.importorskip("flax")

LOOSE = dict(rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ Flax NNX graph objects


def _pair():
    from flax import nnx

    class Pair(nnx.Pytree):  # an NNX graph object, not a Module
        def __init__(self):
            self.w = nnx.Param(jnp.array([1.0, 2.0, -0.5]))
            self.s = nnx.BatchStat(jnp.array([3.0, 4.0, 0.5]))
            self.lin = nnx.Linear(3, 2, rngs=nnx.Rngs(0))

    return Pair()


def _pair_loss(p, x):
    return jnp.sum(jnp.tanh(p.lin(x * p.w * p.s[...])) ** 2)


def test_nnx_pytree_subclass_is_differentiated_in_its_params_as_nnx_grad_does():
    # It was a plain pytree: the BatchStat got a gradient, the result was a Pair, not a State.
    from flax import nnx

    pair, x = _pair(), normal(0, 4, 3)
    before = nnx_snapshot(pair)
    expected = nnx.grad(_pair_loss)(nnx.clone(pair), x)
    assert_trees(ad.gradient(_pair_loss, Active(pair), Constant(x)), expected)
    prepared = ad.prepare(ad.gradient, _pair_loss, Active(pair), Constant(x))
    x2 = normal(1, 4, 3)
    assert_trees(prepared(pair, x2), nnx.grad(_pair_loss)(nnx.clone(pair), x2))
    graphdef, params, rest = nnx.split(pair, nnx.Param, ...)
    tangent = jax.tree_util.tree_map(jnp.ones_like, params)

    def pure(params):
        return _pair_loss(nnx.merge(graphdef, params, rest, copy=True), x)

    hvp = ad.prepare(ad.hvp, _pair_loss, Active(pair), Constant(x), tangent=tangent)
    assert_trees(hvp(pair, x, tangent=tangent), jax.jvp(jax.grad(pure), (params,), (tangent,))[1], **LOOSE)
    assert_same_state(before, nnx_snapshot(pair))


def test_nnx_object_that_is_no_pytree_as_active_and_as_a_new_constant_to_a_prepared_call():
    # An nnx.Object was a static leaf: refused as Active; as a Constant, a new one was a mismatch.
    from flax import nnx

    class Stats(nnx.Object):
        def __init__(self, scale):
            self.s = nnx.BatchStat(jnp.asarray(scale))
            self.lin = nnx.Linear(3, 1, rngs=nnx.Rngs(1))

    def loss(w, stats):
        return jnp.sum(stats.lin(w[None] * stats.s[...]) ** 2) + jnp.sum(w * stats.s[...])

    w, a, b = normal(2, 3), Stats([1.0, 1.0, 1.0]), Stats([5.0, -3.0, 0.5])
    before, check = nnx_snapshot(b), untouched(Active(w), Constant(b))
    prepared = ad.prepare(ad.gradient, loss, Active(w), Constant(a))
    assert_trees(prepared(w, b), jax.grad(loss)(w, b))
    expected = nnx.grad(lambda stats, w: loss(w, stats))(nnx.clone(b), w)
    assert_trees(ad.gradient(lambda stats, w: loss(w, stats), Active(b), Constant(w)), expected)
    assert_same_state(before, nnx_snapshot(b))
    assert check()
    # The kit's intact check looks inside such an object (it saw one leaf, and no change to it).
    b.s[...] = jnp.zeros(3)
    assert not check()


def test_nnx_rngs_inside_an_active_pytree_gets_the_empty_state_nnx_grad_gives():
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.l1, self.l2 = nnx.Linear(3, 4, rngs=rngs), nnx.Linear(4, 1, use_bias=False, rngs=rngs)

        def __call__(self, x, rngs):
            return self.l2(nnx.Dropout(0.5)(jnp.tanh(self.l1(x)), rngs=rngs))

    def loss(both, x):
        return jnp.sum(both["model"](x, both["rngs"]) ** 2)

    model, rngs, x = Model(nnx.Rngs(0)), nnx.Rngs(dropout=7), normal(3, 5, 3)
    before, rngs_before = nnx_snapshot(model), nnx_snapshot(rngs)
    expected = nnx.grad(loss)({"model": nnx.clone(model), "rngs": nnx.clone(rngs)}, x)
    assert_trees(ad.gradient(loss, Active({"model": model, "rngs": rngs}), Constant(x)), expected)
    prepared = ad.prepare(ad.gradient, loss, Active({"model": model, "rngs": rngs}), Constant(x))
    assert_trees(prepared({"model": model, "rngs": rngs}, x), expected)  # the count did not advance
    other = nnx.Rngs(dropout=8)
    assert_trees(prepared({"model": model, "rngs": other}, x), nnx.grad(loss)({"model": nnx.clone(model), "rngs": nnx.clone(other)}, x))
    assert_same_state(before, nnx_snapshot(model))
    assert_same_state(rngs_before, nnx_snapshot(rngs))


def test_nnx_optimizer_stepped_inside_f_maml_across_the_users_training_steps():
    import optax
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1, self.l2 = nnx.Linear(3, 4, rngs=rngs), nnx.Linear(4, 1, rngs=rngs)

        def __call__(self, x):
            return self.l2(jnp.tanh(self.l1(x)))

    def inner(m, x):
        return jnp.mean(m(x) ** 2)

    def maml(m, opt, x):
        opt.update(m, nnx.grad(inner)(m, x))  # writes into the optimiser's moments and the model
        return inner(m, x)

    model, x = MLP(nnx.Rngs(0)), normal(4, 5, 3)
    opt = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)
    prepared = ad.prepare(ad.value_and_gradient, maml, Active(model), Constant(opt), Constant(x))
    for _ in range(2):
        before, opt_before = nnx_snapshot(model), nnx_snapshot(opt)
        expected = nnx.value_and_grad(maml)(nnx.clone(model), nnx.clone(opt), x)
        got = prepared(model, opt, x)
        assert_trees(got, expected)
        assert_same_state(before, nnx_snapshot(model))
        assert_same_state(opt_before, nnx_snapshot(opt))
        opt.update(model, got[1])  # the user's own step with activity's gradient
    assert int(opt.step[...]) == 2
    assert_trees(ad.gradient(maml, Active(model), Constant(opt), Constant(x)), nnx.grad(maml)(nnx.clone(model), nnx.clone(opt), x))


def test_nnx_sow_intermediates_popped_inside_f_never_reach_the_users_model():
    import warnings

    from flax import nnx

    class Sower(nnx.Module):
        def __init__(self, rngs):
            self.l1, self.l2 = nnx.Linear(3, 4, rngs=rngs), nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x):
            h = jnp.tanh(self.l1(x))
            self.sow(nnx.Intermediate, "h", h)
            return self.l2(h)

    def loss(m, x):
        y = m(x)
        (h,) = jax.tree_util.tree_leaves(nnx.pop(m, nnx.Intermediate))
        return jnp.sum(y**2) + jnp.sum(h**2)

    model, x = Sower(nnx.Rngs(0)), normal(5, 5, 3)
    before = nnx_snapshot(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # sow outside nnx.capture
        expected = nnx.grad(loss)(nnx.clone(model), x)
        assert_trees(ad.gradient(loss, Active(model), Constant(x)), expected)
        prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(x))
        assert_trees(prepared(model, x), expected)
    assert_same_state(before, nnx_snapshot(model))
    assert not hasattr(model, "h")


# ------------------------------------------------------------------ Linen and Haiku


def test_linen_sow_batchnorm_dropout_mutable_collections_as_aux():
    import flax.linen as nn

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            h = nn.Dense(4)(x)
            self.sow("intermediates", "h", h)
            h = nn.Dropout(0.3, deterministic=not train)(nn.BatchNorm(use_running_average=not train)(h))
            return nn.Dense(1)(jnp.tanh(h))

    model, x = Model(), normal(6, 6, 3)
    variables = model.init(jax.random.key(0), x, False)
    params, stats = variables["params"], variables["batch_stats"]

    def loss(params, stats, x, key):
        y, updates = model.apply({"params": params, "batch_stats": stats}, x, True, mutable=["batch_stats", "intermediates"], rngs={"dropout": key})
        return jnp.sum(y**2), updates

    key = jax.random.key(3)
    check = untouched(Active(params), Constant(stats), Constant(x), Constant(key))
    got = ad.gradient(loss, Active(params), Constant(stats), Constant(x), Constant(key), has_aux=True)
    assert_trees(got, jax.grad(loss, has_aux=True)(params, stats, x, key))
    prepared = ad.prepare(ad.value_and_gradient, loss, Active(params), Constant(stats), Constant(x), Constant(key), has_aux=True)
    key2 = jax.random.key(4)
    assert_trees(prepared(params, stats, x, key2), jax.value_and_grad(loss, has_aux=True)(params, stats, x, key2))
    tangent = jax.tree_util.tree_map(jnp.ones_like, params)
    pushed = ad.pushforward(lambda *a: loss(*a)[0], Active(params), Constant(stats), Constant(x), Constant(key), tangent=tangent)
    assert_trees(pushed, jax.jvp(lambda p: loss(p, stats, x, key)[0], (params,), (tangent,))[1])
    assert check()


def test_haiku_transform_with_state_batchnorm_and_dropout():
    import haiku as hk

    def forward(x, is_training):
        h = hk.BatchNorm(True, True, 0.9)(hk.Linear(4)(x), is_training)
        if is_training:
            h = hk.dropout(hk.next_rng_key(), 0.2, h)
        return hk.Linear(1)(jax.nn.gelu(h))

    net, x = hk.transform_with_state(forward), normal(7, 6, 3)
    params, state = net.init(jax.random.key(0), x, True)

    def loss(params, state, key, x):
        y, new_state = net.apply(params, state, key, x, True)
        return jnp.mean(y**2), new_state

    key = jax.random.key(1)
    check = untouched(Active(params), Constant(state), Constant(key), Constant(x))
    expected = jax.grad(loss, has_aux=True)(params, state, key, x)
    assert_trees(ad.gradient(loss, Active(params), Constant(state), Constant(key), Constant(x), has_aux=True), expected)
    prepared = ad.prepare(ad.gradient, loss, Active(params), Constant(state), Constant(key), Constant(x), has_aux=True)
    state2, key2 = expected[1], jax.random.key(5)  # the state after a step, a new key
    assert_trees(prepared(params, state2, key2, x), jax.grad(loss, has_aux=True)(params, state2, key2, x))

    def evaluation(params, state, x):
        return jnp.mean(net.apply(params, state, None, x, False)[0] ** 2)

    tangent = jax.tree_util.tree_map(jnp.ones_like, params)
    expected_hvp = jax.jvp(jax.grad(lambda p: evaluation(p, state, x)), (params,), (tangent,))[1]
    assert_trees(ad.hvp(evaluation, Active(params), Constant(state), Constant(x), tangent=tangent), expected_hvp, **LOOSE)
    saliency = ad.jacobian(lambda x, p, s: net.apply(p, s, None, x, False)[0], Active(x), Constant(params), Constant(state))
    assert_trees(saliency, jax.jacobian(lambda x: net.apply(params, state, None, x, False)[0])(x))
    assert check()


# ------------------------------------------------------------------ Equinox


def _fresh(state):
    """A copy of an ``eqx.nn.State`` that Equinox lets be used again (its own recipe)."""
    leaves, treedef = jax.tree_util.tree_flatten(state)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def test_equinox_spectral_norm_state_train_and_inference_mode():
    import equinox as eqx

    linear = eqx.nn.Linear(4, 3, key=jax.random.key(0))
    layer, state = eqx.nn.make_with_state(eqx.nn.SpectralNorm)(linear, "weight", key=jax.random.key(1))
    x = normal(8, 4)

    def loss(layer, state, x):
        y, new_state = layer(x, state)
        return jnp.sum(y**2), new_state

    check = untouched(Active(layer), Constant(state), Constant(x))
    expected = eqx.filter_grad(loss, has_aux=True)(layer, _fresh(state), x)
    assert_trees(ad.gradient(loss, Active(layer), Constant(state), Constant(x), has_aux=True), expected)
    prepared = ad.prepare(ad.gradient, loss, Active(layer), Constant(state), Constant(x), has_aux=True)
    state2 = expected[1]  # the power iteration's next vectors
    assert_trees(prepared(layer, state2, x)[0], eqx.filter_grad(loss, has_aux=True)(layer, _fresh(state2), x)[0])

    frozen = eqx.nn.inference_mode(layer)

    def value(layer, state, x):
        return loss(layer, state, x)[0]

    assert_trees(ad.gradient(value, Active(frozen), Constant(state), Constant(x)), eqx.filter_grad(value)(frozen, _fresh(state), x))
    params, static = eqx.partition(frozen, eqx.is_inexact_array)
    tangent = jax.tree_util.tree_map(jnp.ones_like, params)
    expected_hvp = jax.jvp(lambda p: eqx.filter_grad(value)(eqx.combine(p, static), _fresh(state), x), (params,), (tangent,))[1]
    assert_trees(ad.hvp(value, Active(frozen), Constant(state), Constant(x), tangent=tangent), expected_hvp, **LOOSE)
    assert check()


def test_equinox_weight_norm_conv_and_attention_with_rotary_heads():
    import equinox as eqx

    conv = eqx.nn.WeightNorm(eqx.nn.Conv1d(2, 3, 3, key=jax.random.key(0)))
    signal = normal(9, 2, 8)

    def conv_loss(m, x):
        return jnp.sum(jnp.tanh(m(x)) ** 2)

    params, static = eqx.partition(conv, eqx.is_inexact_array)
    tangent = jax.tree_util.tree_map(jnp.ones_like, params)
    check = untouched(Active(conv), Constant(signal))
    assert_trees(ad.gradient(conv_loss, Active(conv), Constant(signal)), eqx.filter_grad(conv_loss)(conv, signal))
    expected_hvp = jax.jvp(lambda p: eqx.filter_grad(conv_loss)(eqx.combine(p, static), signal), (params,), (tangent,))[1]
    prepared = ad.prepare(ad.hvp, conv_loss, Active(conv), Constant(signal), tangent=tangent)
    assert_trees(prepared(conv, signal, tangent=tangent), expected_hvp, **LOOSE)
    assert check()

    attention, rope = eqx.nn.MultiheadAttention(2, 8, key=jax.random.key(1)), eqx.nn.RotaryPositionalEmbedding(4)

    def heads(q, k, v):
        rotate = jax.vmap(rope, in_axes=1, out_axes=1)
        return rotate(q), rotate(k), v

    def attention_loss(m, x, mask):
        return jnp.sum(m(x, x, x, mask=mask, process_heads=heads) ** 2)

    x, causal = normal(10, 5, 8), jnp.tril(jnp.ones((5, 5), bool))
    prepared = ad.prepare(ad.gradient, attention_loss, Active(attention), Constant(x), Constant(causal))
    assert_trees(prepared(attention, x, causal), eqx.filter_grad(attention_loss)(attention, x, causal))
    x2, full = normal(11, 5, 8), jnp.ones((5, 5), bool)
    assert_trees(prepared(attention, x2, full), eqx.filter_grad(attention_loss)(attention, x2, full))


# ------------------------------------------------------------------ the testing kit on half-precision models


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_check_on_a_half_precision_model_allows_its_rounding_and_still_catches_a_wrong_gradient(dtype):
    # <gradient, u> and <pullback(v), u> were reduced to float64 before the comparison, which then
    # held them to float64's rounding: a right bfloat16 gradient failed where the same model's
    # pushforward, compared in its own dtype, passed.
    import equinox as eqx

    from activity.testing import check

    model = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(1), dtype=getattr(jnp, dtype))
    x = normal(12, 5, 3).astype(dtype)

    def loss(m, x):
        return jnp.sum(jnp.tanh(jax.vmap(m)(x)) ** 2)

    report = check(loss, Active(model), Constant(x), operators=["gradient", "pullback"], directions=2)
    assert len(report.passed) == 4 and not report.unreliable

    @jax.custom_vjp
    def off_tanh(y):  # its derivative 50% too large
        return jnp.tanh(y)

    off_tanh.defvjp(lambda y: (jnp.tanh(y), y), lambda y, g: (1.5 * g * (1 - jnp.tanh(y) ** 2),))

    def wrong(m, x):
        return jnp.sum(off_tanh(jax.vmap(m)(x)) ** 2)

    with pytest.raises(AssertionError, match=r"FAIL  <gradient, u\d> on AutoJAX\(\)"):
        check(wrong, Active(model), Constant(x), operators=["gradient", "pullback"], directions=2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_differentiation_on_half_precision_scenarios_defaults_to_their_rounding(dtype):
    # Scenario's tolerance is documented "default: from the dtypes", but was 1e-5 for every dtype:
    # each operator on a half-precision model failed against the float64 reference.
    import equinox as eqx

    from activity.testing import Scenario, test_differentiation

    layer = eqx.nn.Linear(3, 2, key=jax.random.key(0), dtype=getattr(jnp, dtype))
    x = normal(13, 5, 3).astype(dtype)
    tangent = jax.tree_util.tree_map(jnp.ones_like, eqx.filter(layer, eqx.is_inexact_array))

    def outputs(m, x):
        return jnp.tanh(jax.vmap(m)(x))

    def loss(m, x):
        return jnp.sum(outputs(m, x) ** 2)

    scenarios = [
        Scenario("gradient", loss, (Active(layer), Constant(x)), name="gradient"),
        Scenario("hvp", loss, (Active(layer), Constant(x)), tangent=tangent, name="hvp"),
        Scenario("jacobian", outputs, (Active(layer), Constant(x)), name="jacobian"),
        Scenario("pullback", outputs, (Active(layer), Constant(x)), tangent=jnp.ones((5, 2), dtype), name="pullback"),
    ]
    assert test_differentiation([ad.AutoJAX()], scenarios).counts()["pass"] == 4

    @jax.custom_vjp
    def off_tanh(y):  # its derivative 50% too large
        return jnp.tanh(y)

    off_tanh.defvjp(lambda y: (jnp.tanh(y), y), lambda y, g: (1.5 * g * (1 - jnp.tanh(y) ** 2),))
    wrong = Scenario("gradient", lambda m, x: jnp.sum(off_tanh(jax.vmap(m)(x)) ** 2), (Active(layer), Constant(x)), name="wrong")
    with pytest.raises(AssertionError, match="AutoJAX on wrong"):
        test_differentiation([ad.AutoJAX()], [wrong])
    strict = Scenario("gradient", loss, (Active(layer), Constant(x)), name="strict", atol=1e-5)  # as given
    with pytest.raises(AssertionError, match="AutoJAX on strict"):
        test_differentiation([ad.AutoJAX()], [strict])


# ------------------------------------------------------------------ jax.experimental.sparse


def test_bcoo_constant_with_another_sparsity_names_its_data_in_the_mismatch():
    from jax.experimental import sparse

    def loss(w, m):
        return jnp.sum(jnp.tanh(m @ w) ** 2)

    dense = normal(14, 6, 4)
    m1 = sparse.BCOO.fromdense(jnp.where(dense > 0.3, dense, 0.0))
    m2 = sparse.BCOO.fromdense(jnp.where(dense > -0.3, dense, 0.0))
    assert m1.nse != m2.nse
    w = normal(15, 4)
    prepared = ad.prepare(ad.gradient, loss, Active(w), Constant(m1))
    assert_trees(prepared(w, m1), jax.grad(loss)(w, m1))
    with pytest.raises(ad.PreparationMismatchError, match=r"argument 1 .* at \.data: expected a jax array of shape \(%d,\)" % m1.nse):
        prepared(w, m2)
    lenient = ad.prepare(ad.gradient, loss, Active(w), Constant(m1), strict=False)
    assert_trees(lenient(w, m2), jax.grad(loss)(w, m2))

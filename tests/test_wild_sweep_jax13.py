"""AutoJAX on the libraries users bring (round 13): Flax NNX containers (``nnx.Dict``,
``nnx.List``) with BatchNorm and Dropout, user code built on ``nnx.split`` / ``nnx.merge``
(a State as Active, its GraphDef and the rest of the state as Constants), an ``nnx.Rngs``
passed to f as a Constant, a variable type of the user's own (``class Lora(nnx.Variable)``:
data by NNX's convention; the refusal now names it and says how to differentiate it);
Linen ``batch_stats`` as a Constant and as an Active with a dropout key; Equinox bound
methods as fields, ``eqx.nn.Lambda`` of a ``jax.tree_util.Partial`` holding an array,
``MultiheadAttention`` with a dropout key, BatchNorm state as Constant and as Cache, a
``StateIndex`` state still usable after the calls (``eqx.filter_grad`` leaves it used); an
optax MAML step (gradient and third-order hvp through an SGD-with-momentum step, new
optimiser state to a prepared call) and an
``inject_hyperparams`` learning-rate hypergradient; ``jax.custom_vjp`` under hvp and
pushforward, ``lax.while_loop`` under pushforward and gradient; ``float0`` leaves (from
``jax.grad(..., allow_int=True)``) in an Active pytree and a tangent; a lineax
``FunctionLinearOperator`` as Active, and a new one to a prepared call (a new Jaxpr: the
mismatch now says so and how to pass a new operator); the testing kit's
``test_differentiation`` on a scenario holding a typed PRNG key (it crashed snapshotting it).

Expected values come from ``nnx.grad``, ``eqx.filter_grad`` / ``eqx.filter_jvp`` and
``jax.grad`` / ``jax.jvp`` written out here, never from ``activity``; the user's objects
(NNX state with RNG counts, Rngs, arrays) are checked unchanged.

What f changes in an ``nnx.Rngs`` is not written back (the design's mutation rule): where
``nnx.grad`` advances the user's Rngs on every call, activity's calls leave the count as it
was, so two calls draw the same dropout mask; pass a new Rngs (or ``rngs.fork()``) per step.

Also tried and fine, not kept: a ``jax.custom_vjp`` function under jacobian and hessian; a
``jax.custom_jvp`` one under hvp; complex Actives (refused, naming the path: split them);
int, bool and key leaves next to floats under hessian / jacobian / pushforward; int8
weights with a float scale; float8 and bfloat16 Actives (gradient, hvp, hessian in their
dtype, as ``jax.hessian``); weak-typed scalars; numpy bfloat16 arrays and numpy float
scalars as Actives next to JAX arrays; a ``jax.ShapeDtypeStruct`` inside a Constant (refused:
a placeholder, the message says so); NNX ``nnx.data`` array attributes changed between
prepared calls (seen), a Python float attribute changed (a mismatch naming it), an int
``nnx.Param`` (``None``) and a Param holding a dict; NNX Params sharded by
``nnx.with_partitioning`` over a 2-device CPU mesh (gradient, hvp, prepared; outside the mesh
JAX refuses for ``nnx.grad`` as for activity); Linen ``where=`` over the whole variables
dict, its hvp; Equinox ``__check_init__`` and ``eqx.field(converter=...)`` modules (gradient,
hessian), ``filter_vmap`` ensembles, a static numpy / JAX array field (a prepared call with a
new one is a mismatch naming it; lenient preparation re-prepares, right); optax's L-BFGS
with its zoom line search inside f (a while loop: the note points to forward mode); the MAML
step through two Adam steps (right, but seconds of compile); ``jax.checkpoint`` with the
``dots_saveable``, ``save_only_these_names`` (``checkpoint_name``) and ``nothing_saveable``
policies (gradient, prepared hvp); ``jax.nn.dot_product_attention`` and ``eigh`` hessians,
``associative_scan`` hvp, ``lax.cond`` / ``lax.switch`` on a Constant flag or index in a
prepared call; an NNX ``MultiHeadAttention`` in decode mode (its cache is data: the user's
cache index does not advance; prepared after the user's own step, saliency, two steps in f,
hvp); a BCOO matrix as Active (its ``indices`` get ``None``, as the design says of int
leaves, where ``sparse.grad`` keeps them; the values agree); a dense diffrax ``Solution`` as
a prepared Constant; ``optx.fixed_point`` (gradient, hvp, pushforward); a diffrax SDE whose
``VirtualBrownianTree`` is a Constant, prepared and given a new key (10 s of compile, not
kept: its snapshot for ``untouched`` crashed on the tree's typed key, fixed in the kit).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import activity as ad
from activity import Active, Cache, Constant

from _sweeps import assert_same_state, assert_trees, nnx_snapshot, normal, untouched


# ------------------------------------------------------------------ Flax NNX


def _nnx_containers_model():
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.d = nnx.Dict(a=nnx.Linear(3, 4, rngs=rngs), b=nnx.Linear(4, 2, rngs=rngs))
            self.l = nnx.List([nnx.Linear(2, 2, rngs=rngs), nnx.Linear(2, 1, rngs=rngs)])
            self.bn = nnx.BatchNorm(4, rngs=rngs)
            self.do = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            h = self.d["b"](self.do(self.bn(self.d["a"](x))))
            for layer in self.l:
                h = layer(h)
            return h

    return Model(nnx.Rngs(0, dropout=1))


def _nnx_loss(m, x):
    return jnp.sum(m(x) ** 2)


def test_nnx_dict_and_list_containers_with_batchnorm_and_dropout_in_train_mode():
    from flax import nnx

    model, x = _nnx_containers_model(), normal(0, 5, 3)
    before = nnx_snapshot(model)
    expected = nnx.grad(_nnx_loss)(nnx.clone(model), x)
    assert_trees(ad.gradient(_nnx_loss, Active(model), Constant(x)), expected)
    prepared = ad.prepare(ad.gradient, _nnx_loss, Active(model), Constant(x))
    assert_trees(prepared(model, x), expected)
    assert_trees(prepared(model, x), expected)  # the user's RNG count did not advance
    assert_same_state(before, nnx_snapshot(model))
    x2 = normal(1, 5, 3)
    assert_trees(prepared(model, x2), nnx.grad(_nnx_loss)(nnx.clone(model), x2))


def test_nnx_split_merge_user_code_state_active_graphdef_and_rest_constant():
    # Raw jax.jit(jax.grad(...)) of this f fails (nnx.merge reuses the rest's BatchStat
    # objects, created outside the trace, and BatchNorm writes to them): activity hands f copies.
    from flax import nnx

    model, x = _nnx_containers_model(), normal(2, 5, 3)
    before = nnx_snapshot(model)
    expected = nnx.grad(_nnx_loss)(nnx.clone(model), x)

    graphdef, state = nnx.split(model)

    def whole(state, graphdef, x):
        return _nnx_loss(nnx.merge(graphdef, state), x)

    got = ad.gradient(whole, Active(state), Constant(graphdef), Constant(x))
    assert_trees(nnx.filter_state(got, nnx.Param), expected)

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def split_loss(params, rest, graphdef, x):
        return _nnx_loss(nnx.merge(graphdef, params, rest), x)

    prepared = ad.prepare(ad.gradient, split_loss, Active(params), Constant(rest), Constant(graphdef), Constant(x))
    x2 = normal(3, 5, 3)
    assert_trees(prepared(params, rest, graphdef, x2), nnx.grad(_nnx_loss)(nnx.clone(model), x2))
    assert_same_state(before, nnx_snapshot(model))


def test_nnx_rngs_passed_to_f_as_a_constant_is_not_advanced():
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.l, self.do, self.o = nnx.Linear(3, 8, rngs=rngs), nnx.Dropout(0.5), nnx.Linear(8, 1, rngs=rngs)

        def __call__(self, x, rngs):
            return self.o(self.do(self.l(x), rngs=rngs))

    def loss(m, x, rngs):
        return jnp.sum(m(x, rngs) ** 2)

    model, x, rngs = Model(nnx.Rngs(0)), normal(4, 6, 3), nnx.Rngs(dropout=7)
    before, count = nnx_snapshot(model), int(rngs.dropout.count[...])
    expected = nnx.grad(loss)(nnx.clone(model), x, nnx.clone(rngs))
    assert_trees(ad.gradient(loss, Active(model), Constant(x), Constant(rngs)), expected)
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(x), Constant(rngs))
    assert_trees(prepared(model, x, rngs), expected)
    assert int(rngs.dropout.count[...]) == count
    other = nnx.Rngs(dropout=8)
    assert_trees(prepared(model, x, other), nnx.grad(loss)(nnx.clone(model), x, nnx.clone(other)))
    assert_same_state(before, nnx_snapshot(model))


def _lora_model():
    from flax import nnx

    class Lora(nnx.Variable):
        pass

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.l = nnx.Linear(3, 2, rngs=rngs)
            self.a = Lora(jnp.full((3, 2), 0.1))

        def __call__(self, x):
            return self.l(x) + x @ self.a[...]

    class OnlyLora(nnx.Module):
        def __init__(self):
            self.a = Lora(jnp.full((3, 2), 0.1))

        def __call__(self, x):
            return x @ self.a[...]

    return Lora, Model(nnx.Rngs(0)), OnlyLora()


def test_nnx_variable_type_of_the_users_own_is_data_and_the_refusal_says_how_to_differentiate_it():
    # The message offered only the Param paths to where=, with no word of the Lora variable.
    from flax import nnx

    Lora, model, only = _lora_model()
    x = normal(5, 4, 3)
    with pytest.raises(TypeError, match=r"selects nothing.*a Lora at \['a'\].*nnx\.split\(model, Lora, \.\.\.\)"):
        ad.gradient(_nnx_loss, Active(model, where=lambda path, leaf: path.startswith("['a']")), Constant(x))
    with pytest.raises(TypeError, match=r"no floating-point value.*a Lora at \['a'\].*subclass of nnx\.Param"):
        ad.gradient(_nnx_loss, Active(only), Constant(x))
    # The recipe the message gives, against NNX's own way to differentiate that type.
    graphdef, chosen, rest = nnx.split(model, Lora, ...)

    def split_loss(chosen, rest, graphdef, x):
        return _nnx_loss(nnx.merge(graphdef, chosen, rest), x)

    got = ad.gradient(split_loss, Active(chosen), Constant(rest), Constant(graphdef), Constant(x))
    assert_trees(got, nnx.grad(_nnx_loss, argnums=nnx.DiffState(0, Lora))(model, x))
    # Where the model also has Params, plain Active still differentiates those, as nnx.grad does.
    assert_trees(ad.gradient(_nnx_loss, Active(model), Constant(x)), nnx.grad(_nnx_loss)(nnx.clone(model), x))


# ------------------------------------------------------------------ Flax Linen


def test_linen_batch_stats_constant_and_active_with_a_dropout_key():
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            x = nn.BatchNorm(use_running_average=not train)(nn.Dense(4)(x))
            return nn.Dense(1)(nn.Dropout(0.3, deterministic=not train)(x))

    net, x = Net(), normal(6, 5, 3)
    variables = net.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x, train=False)
    key = jax.random.key(3)

    def loss(params, stats, x, key):
        y, updates = net.apply({"params": params, "batch_stats": stats}, x, train=True, rngs={"dropout": key}, mutable=["batch_stats"])
        return jnp.sum(y**2), updates

    check = untouched(Active(variables), Constant(x))
    params, stats = variables["params"], variables["batch_stats"]
    grads, updates = jax.grad(loss, has_aux=True)(params, stats, x, key)
    got, aux = ad.gradient(loss, Active(params), Constant(stats), Constant(x), Constant(key), has_aux=True)
    assert_trees(got, grads)
    assert_trees(aux, updates)
    both, _ = jax.grad(loss, argnums=(0, 1), has_aux=True)(params, stats, x, key)
    got, _ = ad.gradient(loss, Active(params), Active(stats), Constant(x), Constant(key), has_aux=True)
    assert_trees(got, both)
    other = jax.random.key(4)
    prepared = ad.prepare(ad.gradient, loss, Active(params), Constant(stats), Constant(x), Constant(key), has_aux=True)
    assert_trees(prepared(params, updates["batch_stats"], x, other)[0], jax.grad(loss, has_aux=True)(params, updates["batch_stats"], x, other)[0])
    assert check()


# ------------------------------------------------------------------ Equinox


def test_equinox_bound_method_field_and_lambda_of_a_partial_holding_an_array():
    import equinox as eqx
    from jax.tree_util import Partial

    class Wrap(eqx.Module):
        f: object
        g: eqx.nn.Linear

        def __init__(self, key):
            self.f = eqx.nn.Linear(3, 3, key=key).__call__  # the Linear lives inside the bound method
            self.g = eqx.nn.Linear(3, 1, key=jax.random.fold_in(key, 1))

        def __call__(self, x):
            return self.g(jnp.tanh(self.f(x)))

    def loss(m, x):
        return jnp.sum(jax.vmap(m)(x) ** 2)

    def scale(a, x):
        return a * x

    x = normal(7, 4, 3)
    wrap = Wrap(jax.random.key(1))
    assert_trees(ad.gradient(loss, Active(wrap), Constant(x)), eqx.filter_grad(loss)(wrap, x))
    seq = eqx.nn.Sequential(
        [eqx.nn.Linear(3, 3, key=jax.random.key(2)), eqx.nn.Lambda(Partial(scale, jnp.array(2.0))), eqx.nn.Lambda(jax.nn.tanh)]
    )
    check = untouched(Active(seq), Constant(x))
    assert_trees(ad.gradient(loss, Active(seq), Constant(x)), eqx.filter_grad(loss)(seq, x))
    tangent = eqx.filter(seq, eqx.is_inexact_array)
    _, expected = eqx.filter_jvp(lambda m: eqx.filter_grad(loss)(m, x), (seq,), (tangent,))
    assert_trees(ad.hvp(loss, Active(seq), Constant(x), tangent=tangent), expected, rtol=2e-5, atol=2e-5)
    prepared = ad.prepare(ad.gradient, loss, Active(seq), Constant(x))
    seq3 = eqx.tree_at(lambda m: m.layers[1].fn.args[0], seq, jnp.array(3.0))
    assert_trees(prepared(seq3, x), eqx.filter_grad(loss)(seq3, x))  # the Partial's array is a leaf
    assert check()


def test_equinox_attention_with_a_dropout_key_and_batchnorm_state():
    import equinox as eqx

    mha = eqx.nn.MultiheadAttention(2, 4, dropout_p=0.3, key=jax.random.key(3))
    q = normal(8, 5, 4)

    def attention_loss(m, q, key):
        return jnp.sum(m(q, q, q, key=key, inference=False) ** 2)

    prepared = ad.prepare(ad.gradient, attention_loss, Active(mha), Constant(q), Constant(jax.random.key(5)))
    reference = eqx.filter_jit(eqx.filter_grad(attention_loss))
    for seed in (5, 6):
        key = jax.random.key(seed)
        assert_trees(prepared(mha, q, key), reference(mha, q, key))

    class Net(eqx.Module):
        lin: eqx.nn.Linear
        bn: eqx.nn.BatchNorm

        def __init__(self, key):
            self.lin, self.bn = eqx.nn.Linear(3, 4, key=key), eqx.nn.BatchNorm(4, "batch", mode="batch")

        def __call__(self, x, state):
            return self.bn(self.lin(x), state)

    net, state = eqx.nn.make_with_state(Net)(jax.random.key(4))
    x = normal(9, 6, 3)

    def loss(net, state, x):
        y, new = jax.vmap(net, in_axes=(0, None), out_axes=(0, None), axis_name="batch")(x, state)
        return jnp.sum(y**2), new

    check = untouched(Active(net), Constant(state), Constant(x))
    grads, new = eqx.filter_grad(loss, has_aux=True)(net, state, x)
    got, aux = ad.gradient(loss, Active(net), Constant(state), Constant(x), has_aux=True)
    assert_trees(got, grads)
    assert_trees(aux, new)
    assert_trees(ad.gradient(lambda n, s, x: loss(n, s, x)[0], Active(net), Cache(state), Constant(x)), grads)
    tangent = eqx.filter(net, eqx.is_inexact_array)
    _, expected = eqx.filter_jit(eqx.filter_jvp)(lambda n: eqx.filter_grad(lambda n: loss(n, state, x)[0])(n), (net,), (tangent,))
    assert_trees(ad.hvp(lambda n, s, x: loss(n, s, x)[0], Active(net), Constant(state), Constant(x), tangent=tangent), expected, rtol=2e-5, atol=2e-5)
    assert check()


def test_equinox_state_index_state_stays_usable_after_the_calls():
    # f calls state.set, which marks the State it was called on as used: eqx.filter_grad(f)(m,
    # state, x) leaves the user's State unusable ("Attempted to use old state"); activity hands
    # f a copy, so the user's State still works.
    import equinox as eqx

    class Accumulate(eqx.Module):
        index: eqx.nn.StateIndex
        w: jax.Array

        def __init__(self):
            self.index, self.w = eqx.nn.StateIndex(jnp.zeros(3)), jnp.ones(3)

        def __call__(self, x, state):
            new = state.get(self.index) + self.w * x
            return jnp.sum(new**2), state.set(self.index, new)

    def loss(m, state, x):
        return m(x, state)

    def copy(state):
        return jax.tree_util.tree_unflatten(*reversed(jax.tree_util.tree_flatten(state)))

    model, state = eqx.nn.make_with_state(Accumulate)()
    x = normal(19, 3)
    grads, new = eqx.filter_grad(loss, has_aux=True)(model, copy(state), x)
    got, aux = ad.gradient(loss, Active(model), Constant(state), Constant(x), has_aux=True)
    assert_trees(got, grads)
    assert_trees(aux, new)
    prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(state), Constant(x), has_aux=True)
    assert_trees(prepared(model, state, x)[0], grads)
    _, state1 = model(x, state)  # the user's State is still usable
    assert_trees(prepared(model, state1, x)[0], eqx.filter_grad(loss, has_aux=True)(model, copy(state1), x)[0])


# ------------------------------------------------------------------ optax inside f


def test_optax_maml_momentum_step_gradient_and_third_order_hvp():
    import equinox as eqx
    import optax

    mlp = eqx.nn.MLP(3, 1, 4, 1, activation=jnp.tanh, key=jax.random.key(2))
    x, y = normal(10, 8, 3), normal(11, 8, 1)
    opt = optax.sgd(0.1, momentum=0.9)

    def inner(m, x, y):
        return jnp.mean((jax.vmap(m)(x) - y) ** 2)

    def maml(m, opt_state, x, y):
        updates, opt_state = opt.update(eqx.filter_grad(inner)(m, x, y), opt_state, eqx.filter(m, eqx.is_array))
        return inner(eqx.apply_updates(m, updates), 2 * x, y)

    state0 = opt.init(eqx.filter(mlp, eqx.is_array))
    check = untouched(Active(mlp), Constant(state0), Constant(x))
    # Prepared calls and jitted references: unprepared, activity runs f eagerly, as eager
    # jax.grad does, and through the inner step that took seconds.
    reference = eqx.filter_jit(eqx.filter_grad(maml))
    prepared = ad.prepare(ad.gradient, maml, Active(mlp), Constant(state0), Constant(x), Constant(y))
    state1 = opt.update(eqx.filter(mlp, eqx.is_array), state0)[1]
    for state in (state0, state1):
        assert_trees(prepared(mlp, state, x, y), reference(mlp, state, x, y))
    tangent = jax.tree_util.tree_map(jnp.ones_like, eqx.filter(mlp, eqx.is_inexact_array))
    _, expected = eqx.filter_jit(eqx.filter_jvp)(lambda m: reference(m, state1, x, y), (mlp,), (tangent,))
    hvp = ad.prepare(ad.hvp, maml, Active(mlp), Constant(state0), Constant(x), Constant(y), tangent=tangent)
    assert_trees(hvp(mlp, state1, x, y, tangent=tangent), expected, rtol=1e-4, atol=1e-5)
    assert check()


def test_optax_inject_hyperparams_state_as_active_gives_the_learning_rate_hypergradient():
    import optax

    w, x, y = normal(12, 3), normal(13, 8, 3), normal(14, 8)
    sgd = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    state = sgd.init(w)

    def inner(w, x, y):
        return jnp.mean((x @ w - y) ** 2)

    def after_step(state, w, x, y):
        updates, _ = sgd.update(jax.grad(inner)(w, x, y), state, w)
        return inner(optax.apply_updates(w, updates), x, y)

    def by_rate(rate):
        return w - rate * jax.grad(inner)(w, x, y)

    got = ad.gradient(after_step, Active(state), Constant(w), Constant(x), Constant(y))
    expected = jax.grad(lambda rate: inner(by_rate(rate), x, y))(jnp.asarray(0.1))
    assert got.count is None  # the step count, an int, is data
    np.testing.assert_allclose(got.hyperparams["learning_rate"], expected, rtol=1e-5)


# ------------------------------------------------------------------ lineax


def test_lineax_function_operator_as_active_and_a_new_one_to_a_prepared_call_is_explained():
    # A new FunctionLinearOperator holds a new Jaxpr (eqx.filter_closure_convert), which
    # compares by identity: the mismatch said "pass only the arrays f needs (for a tokenizer's
    # BatchEncoding ...)", nothing of the operator or of how to pass a new one.
    import equinox as eqx
    import lineax as lx

    def operator(a):
        return lx.FunctionLinearOperator(lambda v: a @ v, jax.ShapeDtypeStruct((2,), jnp.float32), tags=lx.positive_semidefinite_tag)

    def solve(op, b):
        return jnp.sum(lx.linear_solve(op, b, lx.CG(rtol=1e-6, atol=1e-6)).value ** 2)

    a, b = jnp.array([[3.0, 1.0], [1.0, 2.0]]), jnp.array([1.0, 2.0])
    op = operator(a)
    check = untouched(Active(op), Constant(b))
    assert_trees(ad.gradient(solve, Active(op), Constant(b)), eqx.filter_grad(solve)(op, b), rtol=1e-5, atol=1e-6)
    prepared = ad.prepare(ad.gradient, lambda b, op: solve(op, b), Active(b), Constant(op))
    assert_trees(prepared(b, op), jax.grad(lambda b: solve(op, b))(b), rtol=1e-5, atol=1e-6)
    with pytest.raises(ad.PreparationMismatchError, match=r"(?s)\.fn\.jaxpr.*lineax\.FunctionLinearOperator.*build that object inside f"):
        prepared(b, operator(2 * a))
    # the recipe: the operator built inside f from its matrix, passed as a Constant
    inside = ad.prepare(ad.gradient, lambda b, a: solve(operator(a), b), Active(b), Constant(a))
    assert_trees(inside(b, 2 * a), jax.grad(lambda b: solve(operator(2 * a), b))(b), rtol=1e-5, atol=1e-6)
    assert check()


def test_the_testing_kit_takes_a_scenario_whose_constant_is_a_typed_prng_key():
    # Its snapshot of the arguments (to check them unchanged) called np.array on the key,
    # which JAX refuses: the run crashed with a TypeError before any call.
    from activity.testing import Scenario, test_differentiation

    def noisy(x, key):
        return jnp.sum(x * jax.random.normal(key, (3,)))

    key, x = jax.random.key(0), normal(20, 3)
    expected = jax.grad(noisy)(x, key)
    report = test_differentiation([ad.AutoJAX()], [Scenario("gradient", noisy, (Active(x), Constant(key)), result=expected)])
    assert "1 passed, 0 failed" in str(report)


# ------------------------------------------------------------------ custom rules and loops


def test_custom_vjp_under_hvp_is_right_and_under_pushforward_is_explained():
    @jax.custom_vjp
    def sin(x):
        return jnp.sin(x)

    sin.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,))

    def loss(x):
        return jnp.sum(sin(x) ** 2)

    x, t = jnp.arange(3.0), jnp.array([1.0, -2.0, 0.5])
    # forward over reverse: the reverse rule is plain jnp, which forward mode differentiates
    np.testing.assert_allclose(ad.hvp(loss, Active(x), tangent=t), 2 * jnp.cos(2 * x) * t, rtol=1e-5)
    with pytest.raises(TypeError, match="custom_vjp") as info:
        ad.pushforward(sin, Active(x), tangent=t)
    assert any("reverse mode only" in note for note in info.value.__notes__)


def test_while_loop_forward_mode_is_right_and_reverse_mode_is_explained():
    def loop(x):
        _, v = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * jnp.cos(c[1])), (0, x))
        return jnp.sum(v)

    x, t = normal(15, 3), normal(16, 3)
    assert_trees(ad.pushforward(loop, Active(x), tangent=t), jax.jvp(loop, (x,), (t,))[1])
    with pytest.raises(ValueError, match="while_loop") as info:
        ad.gradient(loop, Active(x))
    assert any("Forward mode differentiates such a loop" in note for note in info.value.__notes__)


def test_float0_leaves_from_an_allow_int_gradient_in_an_active_pytree_and_a_tangent():
    value = {"w": normal(17, 3), "n": jnp.array(2)}
    zero = jax.grad(lambda p: jnp.sum(p["w"] * p["n"]), allow_int=True)(value)
    assert zero["n"].dtype == jax.dtypes.float0

    def loss(p):
        return jnp.sum(p["w"] ** 3)

    got = ad.gradient(loss, Active(zero))
    assert got["n"] is None
    np.testing.assert_allclose(got["w"], jax.grad(loss)({"w": zero["w"], "n": None})["w"], rtol=1e-6)
    # a float0 tangent for the int leaf (what JAX's own tangents hold there)
    tangent = {"w": normal(18, 3), "n": zero["n"]}
    assert_trees(
        ad.pushforward(lambda p: p["w"] * p["n"], Active(value), tangent=tangent),
        jax.jvp(lambda w: w * value["n"], (value["w"],), (tangent["w"],))[1],
    )

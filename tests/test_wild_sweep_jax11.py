"""AutoJAX on the libraries users bring (round 11): Penzai models (``pz.nn`` layers holding
``pz.Parameter`` and ``pz.StateVariable`` objects) as Active and as prepared Constants, chex
and ``flax.struct`` dataclasses, distrax distributions and bijectors, flowjax flows,
blackjax log densities, ``jax.experimental.sparse`` matrices, ``checkify`` and
``pure_callback`` inside f, and arrays placed on a device or sharded over a CPU mesh.
Expected values come from ``jax.grad`` / ``jax.jvp`` on Penzai's own recipe
(``pz.unbind_variables`` and ``pz.bind_variables``), ``eqx.filter_grad``, or the
float64 finite-difference reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from beartype import beartype
from jaxtyping import Array, Float, Float32, jaxtyped

import activity as ad
from activity import Active, Constant

from _sweeps import assert_trees


# ------------------------------------------------------------------ Penzai


def _penzai_mlp():
    from penzai import pz

    return pz.nn.Sequential([
        pz.nn.Linear.from_config(name="l1", init_base_rng=jax.random.key(0), input_axes={"features": 3}, output_axes={"out": 4}),
        pz.nn.AddBias.from_config(name="b1", init_base_rng=jax.random.key(2), biased_axes={"out": 4}),
        pz.nn.Elementwise(jnp.tanh),
    ])


def _named(seed):
    from penzai import pz

    return pz.nx.wrap(jax.random.normal(jax.random.key(seed), (5, 3))).tag("batch", "features")


def _penzai_loss(model, x):
    return (model(x).untag("batch", "out").unwrap() ** 2).sum()


def test_a_penzai_model_is_differentiated_in_its_parameters_as_penzais_own_recipe_does():
    # Penzai's parameters are mutable pz.Parameter objects, leaves to JAX: taken as a plain
    # pytree the model held "no floating-point value" (a TypeError).
    from penzai import pz

    model, x = _penzai_mlp(), _named(1)
    unbound, frozen = pz.unbind_params(model, freeze=True)
    reference = lambda params, x: _penzai_loss(pz.bind_variables(unbound, params), x)  # noqa: E731
    expected = jax.grad(reference)(frozen, x)
    grads = ad.gradient(_penzai_loss, Active(model), Constant(x))
    assert [type(p).__name__ for p in grads] == ["ParameterValue", "ParameterValue"]
    assert [p.label for p in grads] == ["l1.weights", "b1.bias"]
    assert_trees(grads, expected)
    assert_trees(ad.hvp(_penzai_loss, Active(model), Constant(x), tangent=frozen),
                 jax.jvp(lambda p: jax.grad(reference)(p, x), (frozen,), (frozen,))[1])
    assert_trees(ad.gradient(_penzai_loss, Active(model), Constant(x), backend=ad.AutoFiniteDifferences()), expected, rtol=1e-4, atol=1e-5)
    # a where= callable is given each Parameter's label
    head = ad.gradient(_penzai_loss, Active(model, where=lambda path, leaf: path == "b1.bias"), Constant(x))
    assert head[0].value.data_array is None
    np.testing.assert_allclose(head[1].value.data_array, expected[1].value.data_array, rtol=2e-5, atol=2e-6)
    # a container of a model and a loose array: the array has no place in that result (it was
    # differentiated alone, the model's Parameters silently not at all)
    scaled = lambda p, x: p["scale"] * _penzai_loss(p["model"], x)  # noqa: E731
    with pytest.raises(TypeError, match=r"floating arrays outside them at \['scale'\]"):
        ad.gradient(scaled, Active({"model": model, "scale": jnp.array(2.0)}), Constant(x))


def test_a_prepared_penzai_model_sees_its_parameters_updated_in_place_and_new_data():
    # A Constant model's Parameters were static values compiled in: after `param.value = ...`
    # the prepared call returned the old model's gradient (it only warned at prepare).
    from penzai import pz

    model = _penzai_mlp()
    x = jax.random.normal(jax.random.key(1), (5, 3))
    f = lambda x, model: _penzai_loss(model, pz.nx.wrap(x).tag("batch", "features"))  # noqa: E731
    prepared = ad.prepare(ad.gradient, f, Active(x), Constant(model))
    np.testing.assert_allclose(prepared(x, model), jax.grad(f)(x, model), rtol=2e-5, atol=2e-6)
    weights = pz.unbind_params(model)[1][0]
    weights.value = weights.value * 2.0
    np.testing.assert_allclose(prepared(2 * x, model), jax.grad(f)(2 * x, model), rtol=2e-5, atol=2e-6)

    trained = ad.prepare(ad.value_and_gradient, _penzai_loss, Active(model), Constant(_named(1)))
    unbound, frozen = pz.unbind_params(model, freeze=True)
    value, grads = trained(model, _named(7))
    reference = lambda params, x: _penzai_loss(pz.bind_variables(unbound, params), x)  # noqa: E731
    np.testing.assert_allclose(value, reference(frozen, _named(7)), rtol=2e-5)
    assert_trees(grads, jax.grad(reference)(frozen, _named(7)))
    # a model of other sizes is told by the Parameter that changed (it named split-tree paths)
    wider = pz.nn.Linear.from_config(name="l1", init_base_rng=jax.random.key(0), input_axes={"features": 3}, output_axes={"out": 5})
    with pytest.raises(ad.PreparationMismatchError, match=r"its Parameter 'l1.weights' holds float32\[3, 5\] \(named axes features=3, out=5\), prepared with float32\[3, 4\]"):
        trained(pz.nn.Sequential([wider, *model.sublayers[1:]]), _named(7))


def test_a_penzai_state_variable_f_writes_is_never_the_users_and_a_shared_parameter_is_one_entry():
    # f got the user's own variables: a StateVariable it wrote (a call counter, a KV cache)
    # stayed written in the user's model after the call.
    from penzai import pz

    @pz.pytree_dataclass
    class Counted(pz.nn.Layer):
        weight: pz.Parameter
        calls: pz.StateVariable

        def __call__(self, x, **side_inputs):
            self.calls.value = self.calls.value + 1.0
            return jnp.tanh(x @ self.weight.value) * self.calls.value

    layer = Counted(weight=pz.Parameter(value=jnp.array([[0.5, -1.0], [0.3, 0.2]]), label="w"),
                    calls=pz.StateVariable(value=jnp.array(0.0), label="calls"))
    model = pz.nn.Sequential([layer, layer])  # one layer, one Parameter, used twice
    x = jnp.array([[1.0, 2.0], [-0.5, 0.1]])

    def loss(model, x):
        return jnp.sum(model(x) ** 2), pz.unbind_state_vars(model, freeze=True)[1]

    unbound, variables = pz.unbind_variables(model, freeze=True)
    params = tuple(v for v in variables if isinstance(v, pz.ParameterValue))
    states = tuple(v for v in variables if not isinstance(v, pz.ParameterValue))
    reference = lambda params, x: loss(pz.bind_variables(unbound, [v.unfreeze_as_copy() for v in params + states]), x)  # noqa: E731
    expected = jax.grad(reference, has_aux=True)(params, x)
    assert_trees(ad.gradient(loss, Active(model), Constant(x), has_aux=True), expected)
    assert_trees(ad.gradient(lambda x, m: loss(m, x), Active(x), Constant(model), has_aux=True)[1], expected[1])
    assert float(layer.calls.value) == 0.0  # the new count came back as aux only


# ------------------------------------------------------------------ forward-only operations


def test_jacobian_takes_forward_mode_through_an_operation_without_a_reverse_rule():
    # jacobian linearised f in reverse mode before choosing its mode, so an f with more
    # outputs than inputs through a custom_vmap function (or a Pallas kernel) was refused.
    @jax.custom_batching.custom_vmap
    def sine(x):
        return jnp.sin(x)

    @sine.def_vmap
    def _(axis_size, in_batched, xs):
        return jnp.sin(xs), in_batched[0]

    grid = jnp.arange(4.0) / 4
    tall = lambda s, grid: sine(grid * s)  # noqa: E731
    s = jnp.array(0.5)
    np.testing.assert_allclose(ad.jacobian(tall, Active(s), Constant(grid)), jax.jacfwd(tall)(s, grid), rtol=1e-6)
    prepared = ad.prepare(ad.value_and_jacobian, tall, Active(s), Constant(grid))
    value, jac = prepared(2 * s, grid)
    np.testing.assert_allclose(value, tall(2 * s, grid), rtol=1e-6)
    np.testing.assert_allclose(jac, jax.jacfwd(tall)(2 * s, grid), rtol=1e-6)
    # reverse mode is still refused, with a note on what differentiates such an f
    with pytest.raises(ValueError, match="Linearization failed") as refused:
        ad.gradient(lambda x: jnp.sum(sine(x)), Active(grid))
    (note,) = [note for note in refused.value.__notes__ if note.startswith("(raised by JAX when activity.gradient")]
    assert "activity.pushforward" in note and "jax.custom_vjp" in note


# ------------------------------------------------------------------ devices and sharding

_ON_TWO_DEVICES = '''
import jax, jax.numpy as jnp, numpy as np
import activity as ad
from activity import Active, Constant
from jax.sharding import NamedSharding, PartitionSpec as P

assert len(jax.devices()) == 2
f = lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)
mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
w = jax.device_put(jnp.arange(8.0).reshape(4, 2) / 8, NamedSharding(mesh, P("data", None)))
x = jax.device_put(jnp.ones((6, 4)), NamedSharding(mesh, P(None, "data")))
prepared = ad.prepare(ad.gradient, f, Active(w), Constant(x))
for data in (x, 2 * x):
    np.testing.assert_allclose(prepared(w, data), jax.grad(f)(w, data), rtol=1e-5)
reference = ad.gradient(f, Active(w), Constant(x), backend=ad.AutoFiniteDifferences())
np.testing.assert_allclose(reference, jax.grad(f)(w, x), rtol=1e-4)
assert reference.sharding.mesh == mesh and reference.devices() == w.devices()  # on the mesh, replicated

# results come back on the device of the inputs, from every backend
on_one = jax.device_put(jnp.array([0.5, -1.0, 2.0]), jax.devices()[1])
cube = lambda w: jnp.sum(w ** 3)
for backend in (ad.AutoJAX(), ad.AutoFiniteDifferences()):
    value, grad = ad.value_and_gradient(cube, Active(on_one), backend=backend)
    assert value.devices() == grad.devices() == {jax.devices()[1]}, (backend, value.devices(), grad.devices())
    np.testing.assert_allclose(grad, 3 * on_one ** 2, rtol=1e-5)
    jac = ad.jacobian(lambda w: w ** 2, Active(on_one), backend=backend)
    assert jac.devices() == {jax.devices()[1]}, (backend, jac.devices())

# an explicit mesh (jax.make_mesh's default axis type, under jax.set_mesh): JAX wants cotangents
# sharded as f's outputs, and activity's basis and the user's cotangents were not
explicit = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
with jax.set_mesh(explicit):
    w = jax.device_put(jnp.arange(8.0).reshape(4, 2) / 8, NamedSharding(explicit, P("data", None)))
    tall = lambda w, c: jnp.tanh(w) * c
    c = jnp.array(2.0)
    np.testing.assert_allclose(ad.jacobian(tall, Active(w), Constant(c)), jax.jacobian(tall)(w, c), rtol=1e-6)
    prepared = ad.prepare(ad.jacobian, tall, Active(w), Constant(c))
    np.testing.assert_allclose(prepared(w, 3 * c), jax.jacobian(tall)(w, 3 * c), rtol=1e-6)
    cotangent = jnp.arange(8.0).reshape(4, 2)  # not sharded: taken as jax.vjp would take it sharded
    expected = jax.vjp(lambda w: tall(w, c), w)[1](jax.sharding.reshard(cotangent, P("data", None)))[0]
    np.testing.assert_allclose(ad.pullback(tall, Active(w), Constant(c), cotangent=cotangent), expected, rtol=1e-6)
print("ok")
'''


def test_sharded_and_placed_arrays_keep_their_device_and_an_explicit_mesh_takes_reverse_mode():
    # The finite-difference reference took its differences in numpy and returned JAX arrays on
    # the default device, whatever device the Active arrays were committed to.
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(ad.__file__).resolve().parent.parent  # the activity this suite imports
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", _ON_TWO_DEVICES], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


# ------------------------------------------------------------------ jaxtyping and beartype


# At module level: with `from __future__ import annotations` the hints are strings, which
# beartype resolves in the function's globals (inside a test function they went unchecked).
@jaxtyped(typechecker=beartype)
def _typed_loss(w: Float[Array, " n"], x: Float[Array, "b n"]) -> Float[Array, ""]:
    return jnp.sum(jnp.tanh(x @ w) ** 2)


@jaxtyped(typechecker=beartype)
def _float32_loss(w: Float32[Array, " n"], x: Float32[Array, "b n"]) -> Float32[Array, ""]:
    return _typed_loss(w, x)


def test_a_jaxtyped_function_runs_on_every_backend_and_a_float32_check_under_the_reference_is_explained():
    w, x = jnp.array([0.3, -0.2, 0.5]), jax.random.normal(jax.random.key(0), (4, 3))
    expected = jax.grad(_typed_loss)(w, x)
    np.testing.assert_allclose(ad.gradient(_typed_loss, Active(w), Constant(x)), expected, rtol=1e-6)
    np.testing.assert_allclose(ad.gradient(_typed_loss, Active(w), Constant(x), backend=ad.AutoFiniteDifferences()), expected, rtol=1e-4)
    # the reference evaluates f in float64: the check refuses, and a note says why and what to do
    with pytest.raises(Exception, match="float64") as refused:
        ad.gradient(_float32_loss, Active(w), Constant(x), backend=ad.AutoFiniteDifferences())
    assert any(note.startswith("AutoFiniteDifferences evaluates f in float64") for note in refused.value.__notes__)


# ------------------------------------------------------------------ libraries that just work (regression guards)


def test_chex_and_flax_struct_dataclasses_keep_their_static_fields_static():
    import chex
    import flax.struct

    @chex.dataclass
    class Params:
        w: chex.Array
        b: chex.Array

    loss = lambda p, x: jnp.sum(jnp.tanh(x @ p.w + p.b) ** 2)  # noqa: E731
    p, x = Params(w=jnp.full((3, 2), 0.3), b=jnp.array([0.1, -0.2])), jax.random.normal(jax.random.key(0), (4, 3))
    grads = ad.gradient(loss, Active(p), Constant(x))
    assert type(grads) is Params
    assert_trees(grads, jax.grad(loss)(p, x))
    only_w = ad.gradient(loss, Active(p, where=Params(w=True, b=False)), Constant(x))
    assert only_w.b is None and np.allclose(only_w.w, grads.w)

    @flax.struct.dataclass
    class Scaled:
        w: jax.Array
        act: object = flax.struct.field(pytree_node=False)
        scale: float = flax.struct.field(pytree_node=False, default=2.0)

    f = lambda s, x: s.scale * jnp.sum(s.act(s.w * x))  # noqa: E731
    s, data = Scaled(w=jnp.ones(3), act=jnp.tanh), jnp.arange(3.0)
    prepared = ad.prepare(ad.gradient, f, Active(s), Constant(data))
    assert_trees(prepared(s, data + 1), jax.grad(f)(s, data + 1))
    with pytest.raises(ad.PreparationMismatchError, match="static data of a node differs"):
        prepared(s.replace(scale=5.0), data)  # a pytree_node=False field is compiled in: never reused stale


def test_distrax_distributions_and_bijectors_as_active_and_as_prepared_constants():
    import distrax

    x = jnp.array([0.3, -1.2, 2.0])
    log_prob = lambda d, x: jnp.sum(d.log_prob(x))  # noqa: E731
    mvn = distrax.MultivariateNormalTri(jnp.zeros(2), jnp.array([[1.0, 0.0], [0.3, 0.8]]))
    points = jnp.array([[0.1, 0.2], [-0.5, 1.0]])
    assert_trees(ad.gradient(log_prob, Active(mvn), Constant(points)), jax.grad(log_prob)(mvn, points))

    def flow(params, x):
        bijector = distrax.Chain([distrax.ScalarAffine(params["shift"], params["scale"]), distrax.Tanh()])
        return log_prob(distrax.Transformed(distrax.Normal(jnp.zeros(3), jnp.ones(3)), bijector), x)

    params, inside = {"shift": jnp.array(0.1), "scale": jnp.array(1.3)}, jnp.array([0.2, -0.3, 0.5])
    assert_trees(ad.gradient(flow, Active(params), Constant(inside)), jax.grad(flow)(params, inside))

    score = lambda x, d: jnp.sum(d.log_prob(x))  # noqa: E731
    prepared = ad.prepare(ad.gradient, score, Active(x), Constant(distrax.Normal(jnp.array(0.5), jnp.array(1.5))))
    other = distrax.Normal(jnp.array(1.0), jnp.array(2.0))  # new parameters: new data, not the prepared ones
    np.testing.assert_allclose(prepared(x, other), jax.grad(score)(x, other), rtol=1e-6)


def test_a_flowjax_flow_and_a_blackjax_hmc_step():
    import blackjax
    import equinox as eqx
    import paramax
    from flowjax.distributions import Normal
    from flowjax.flows import masked_autoregressive_flow

    flow = masked_autoregressive_flow(jax.random.key(0), base_dist=Normal(jnp.zeros(2)), nn_width=4, nn_depth=1, flow_layers=1)
    nll = lambda flow, x: -jnp.mean(paramax.unwrap(flow).log_prob(x))  # noqa: E731
    x = jax.random.normal(jax.random.key(1), (5, 2))
    prepared = ad.prepare(ad.value_and_gradient, nll, Active(flow), Constant(x))
    value, grads = prepared(flow, 2 * x)
    expected_value, expected = eqx.filter_jit(eqx.filter_value_and_grad(nll))(flow, 2 * x)
    np.testing.assert_allclose(value, expected_value, rtol=1e-6)
    assert_trees(grads, expected)

    hmc = blackjax.hmc(lambda q: -0.5 * jnp.sum(q**2 * jnp.array([1.0, 4.0])), step_size=0.1,
                       inverse_mass_matrix=jnp.ones(2), num_integration_steps=2)
    q, key = jnp.array([0.5, -0.3]), jax.random.key(0)
    state = hmc.init(q)  # a NamedTuple state as Active
    moved = lambda s, key: jnp.sum(hmc.step(key, s)[0].position ** 2)  # noqa: E731
    assert_trees(ad.gradient(moved, Active(state), Constant(key)), jax.grad(moved)(state, key))


def test_sparse_matrices_checkify_and_pure_callback_inside_f():
    from jax.experimental import checkify, sparse

    x = jnp.array([0.5, -1.0, 2.0])
    squared = lambda x, m: jnp.sum((m @ x) ** 2)  # noqa: E731
    first = sparse.BCOO.fromdense(jnp.array([[1.0, 0, 2.0], [0, 3.0, 0]]))
    second = sparse.BCOO.fromdense(jnp.array([[0.0, 1.0, 2.0], [4.0, 0, 0]]))  # the same number of entries
    prepared = ad.prepare(ad.gradient, squared, Active(x), Constant(first))
    for m in (first, second):
        np.testing.assert_allclose(prepared(x, m), jax.grad(squared)(x, m))
    grads = ad.gradient(lambda m, x: squared(x, m), Active(first), Constant(x))  # its int indices get None
    assert grads.indices is None
    np.testing.assert_allclose(grads.data, jax.grad(lambda m, x: squared(x, m), allow_int=True)(first, x).data)

    def checked(x):
        checkify.check(jnp.all(x > -5), "x too small")
        return jnp.sum(jnp.sin(x) * x)

    def with_error(x):
        error, out = checkify.checkify(checked)(x)
        return out, error

    grads, error = ad.prepare(ad.gradient, with_error, Active(x), has_aux=True)(2 * x)
    np.testing.assert_allclose(grads, jax.grad(checked)(2 * x), rtol=1e-6)
    assert error.get() is None

    @jax.custom_jvp
    def host_sin(x):
        return jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x, vmap_method="sequential")

    host_sin.defjvp(lambda primals, tangents: (host_sin(primals[0]), jnp.cos(primals[0]) * tangents[0]))
    f = lambda x: host_sin(x) * x  # noqa: E731
    np.testing.assert_allclose(ad.jacobian(f, Active(x)), jax.jacrev(f)(x), rtol=1e-6)
    np.testing.assert_allclose(ad.gradient(lambda x: jnp.sum(f(x)), Active(x), backend=ad.AutoFiniteDifferences()),
                               jax.grad(lambda x: jnp.sum(f(x)))(x), rtol=1e-4)

# pyright: strict
"""A user's script that calls the public API the documented way, fully typed.

`tests/test_typing.py` checks it with ``mypy --strict`` and pyright in strict mode:
nothing from activity may be unknown, and the ``assert_type`` lines pin the
result types the overloads promise. Collected by pytest (``--doctest-modules``
imports it), it also runs, so the types describe what the calls really return.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import torch
from flax import nnx
from typing_extensions import assert_type

import activity as ad
from activity import Active, Cache, Constant
from activity.testing import Report, Scenario, assert_tree_allclose, default_scenarios, test_differentiation


def jarray(values: Any) -> jax.Array:
    """A JAX array (jax's own signatures hold an unknown type under pyright strict)."""
    return jnp.asarray(values)  # pyright: ignore[reportUnknownMemberType]


# -- the README example, with the annotations a strict user writes --------------------------------
def loss(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return jnp.mean((x @ params["w"] + params["b"]) ** 2)


params = {"w": jarray([1.0, 1.0, 1.0]), "b": jarray(0.5)}
grads = ad.gradient(loss, Active(params), Constant(jarray([[1.0] * 3] * 4)))
assert_type(grads, dict[str, jax.Array])
step = ad.prepare(ad.gradient, loss, Active(params), Constant(jarray([[1.0] * 3] * 4)))
grads = step(params, jarray([[0.0] * 3] * 4))
assert_type(grads, dict[str, jax.Array])
assert isinstance(grads["w"], jax.Array)

value, grads = ad.value_and_gradient(loss, Active(params), Constant(jarray([[1.0] * 3] * 4)))
assert_type(value, jax.Array)


def loss_with_aux(w: jax.Array, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    prediction = x @ w
    return jnp.sum(prediction**2), {"prediction": prediction}


w = jarray([1.0, -1.0, 0.5])
g, aux = ad.gradient(loss_with_aux, Active(w), Constant(jarray([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])), has_aux=True)
assert_type(g, jax.Array)
assert_type(aux, dict[str, jax.Array])
tangent_out = ad.pushforward(jnp.sin, Active(w), tangent=jarray([1.0] * 3))
assert_type(tangent_out, jax.Array)


def cube_sum(v: jax.Array) -> jax.Array:
    return jnp.sum(v**3)


hvps = ad.hvp(cube_sum, Active(w), tangents=[jarray([1.0] * 3), jarray([0.0] * 3)])
assert_type(hvps, list[jax.Array])
# One array in and one array out: a Jacobian or Hessian is an array of f's framework.
jac = ad.jacobian(jnp.sin, Active(w))
assert_type(jac, jax.Array)
jac, jac_aux = ad.jacobian(loss_with_aux, Active(w), Constant(jarray([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])), has_aux=True)
assert_type(jac, jax.Array)
assert_type(jac_aux, dict[str, jax.Array])
hess = ad.hessian(cube_sum, Active(w))
assert_type(hess, jax.Array)
assert isinstance(hess, jax.Array) and hess.shape == (3, 3)

# Several Active arguments: a tuple of their types, in order.
g_params, g_x = ad.gradient(loss, Active(params), Active(jarray([[1.0] * 3] * 4)))
assert_type(g_params, dict[str, jax.Array])
assert_type(g_x, jax.Array)
(g_w, g_x), aux = ad.gradient(loss_with_aux, Active(w), Active(jarray([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])), has_aux=True)
assert_type(g_w, jax.Array)
assert_type(aux, dict[str, jax.Array])
value, (g_params, g_x) = ad.value_and_gradient(loss, Active(params), Active(jarray([[1.0] * 3] * 4)))
assert_type(g_params, dict[str, jax.Array])


def orbit(t: jax.Array, r: jax.Array) -> jax.Array:
    return r * jnp.stack([jnp.cos(t), jnp.sin(t)])


d_t, d_r = ad.derivative(orbit, Active(jarray(0.5)), Active(jarray(2.0)))
assert_type(d_t, jax.Array)
assert d_r.shape == (2,)


# A number as the Active value: its gradient is the framework's scalar (Any), the aux f's own.
def number_loss(t: float) -> tuple[jax.Array, str]:
    return jnp.sin(t), "note"


g_t, note = ad.gradient(number_loss, Active(0.5), has_aux=True, backend=ad.AutoJAX())
assert_type(note, str)
prepared_hvp = ad.prepare(ad.hvp, cube_sum, Active(w), tangent=jarray([1.0] * 3))
assert isinstance(prepared_hvp(w, tangent=jarray([1.0] * 3)), jax.Array)


# -- JAX models: an Equinox module's gradient is that module; an NNX module's, its nnx.State -------
def eqx_loss(model: eqx.nn.Linear, x: jax.Array) -> jax.Array:
    return jnp.sum(model(x) ** 2)


def nnx_loss(model: nnx.Linear, x: jax.Array) -> jax.Array:
    return jnp.sum(model(x) ** 2)


eqx_grads = ad.gradient(eqx_loss, Active(eqx.nn.Linear(3, 2, key=jax.random.key(0))), Constant(w))
assert_type(eqx_grads, eqx.nn.Linear)
assert isinstance(eqx_grads, eqx.nn.Linear)
nnx_grads = ad.gradient(nnx_loss, Active(nnx.Linear(3, 2, rngs=nnx.Rngs(0))), Constant(w))
assert_type(nnx_grads, nnx.State[Any, Any])
assert isinstance(nnx_grads, nnx.State)


# -- PyTorch: a module gives a dict keyed like named_parameters() ---------------------------------
def torch_loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = model(x)
    return out.pow(2).mean()


model = torch.nn.Linear(3, 2)
module_grads = ad.gradient(torch_loss, Active(model), Constant(torch.ones(4, 3)))
assert_type(module_grads, dict[str, torch.Tensor])
assert set(module_grads) == {"weight", "bias"}
loss_value, module_grads = ad.value_and_gradient(torch_loss, Active(model), Constant(torch.ones(4, 3)))
assert_type(loss_value, torch.Tensor)


def with_scratch(x: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    buffer[:] = 3 * x
    return buffer.sum()


scratch_grad = ad.gradient(with_scratch, Active(torch.ones(2)), Cache(torch.zeros(2)))
assert_type(scratch_grad, torch.Tensor)
backend: ad.Backend = ad.AutoTorch()
prepared_torch = ad.prepare(ad.gradient, torch_loss, Active(model), Constant(torch.ones(4, 3)), backend=backend)
# With a keyword, mypy types this Prepared[Any] (it cannot follow the operator's keywords yet);
# pyright gives Prepared[dict[str, Tensor]].
prepared_grads: dict[str, torch.Tensor] = prepared_torch(model, torch.zeros(4, 3))
prepared_value_and_grads = ad.prepare(ad.value_and_gradient, torch_loss, Active(model), Constant(torch.ones(4, 3)))
loss_value, module_grads = prepared_value_and_grads(model, torch.zeros(4, 3))
assert_type(loss_value, torch.Tensor)
assert_type(module_grads, dict[str, torch.Tensor])


# -- the testing kit: a list of annotations is a Scenario's args ----------------------------------
def tanh_loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w).pow(2).sum()


x = torch.linspace(-1, 1, 12).reshape(4, 3)
weights = torch.tensor([0.3, -0.2, 0.5])
scenario = Scenario("gradient", tanh_loss, [Active(weights), Constant(x)],
                    prep_args=[Active(torch.zeros(3)), Constant(2 * x)], name="tanh")
assert_type(scenario.name, str)
report = test_differentiation([ad.AutoTorch()], [scenario, *default_scenarios("torch")[:2]])
assert_type(report, Report)
assert report.counts()["pass"] == 3
assert_tree_allclose(scenario.run(ad.AutoTorch()), scenario.expected(), rtol=1e-6, atol=1e-9)

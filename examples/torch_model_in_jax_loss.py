"""A PyTorch model inside a JAX loss: JAX differentiates, torch supplies the model's derivatives.

A small torch network (think: a pretrained surrogate) is called from a jitted JAX
objective; `differentiate_with(model, AutoTorch())` makes it a JAX function, so
`jax.grad`, `jax.jit`, `jax.vmap` and `jax.hessian` work through it. We optimise the
network's *input* with gradient descent in JAX, and check the gradient against the
same network written in JAX with copied weights.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch

import activity as ad
from activity import Constant

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
surrogate = ad.differentiate_with(model, ad.AutoTorch())  # takes and returns JAX arrays


def objective(x, target):
    """JAX code around the torch model: squared distance of its prediction to a target."""
    return jnp.sum((surrogate(x) - target) ** 2) + 1e-6 * jnp.sum(x**2)


step = jax.jit(jax.value_and_grad(objective))
x = jnp.zeros((1, 2))
target = surrogate(jnp.array([[0.8, -0.5]])) + 0.01  # a prediction the network can make
for iteration in range(150):
    value, grad = step(x, target)
    x = x - 20.0 * grad
    if iteration % 50 == 0:
        print(f"iter {iteration:2d}  objective {float(value):.5f}")
print(f"prediction at the optimised input: {float(surrogate(x)[0, 0]):.4f} (target {float(target[0, 0]):.4f})")

# The same network in plain JAX, weights copied: its gradient is the reference.
W = {name: jnp.asarray(p.detach().numpy()) for name, p in model.named_parameters()}


def objective_in_jax(x, target):
    prediction = jnp.tanh(x @ W["0.weight"].T + W["0.bias"]) @ W["2.weight"].T + W["2.bias"]
    return jnp.sum((prediction - target) ** 2) + 1e-6 * jnp.sum(x**2)


ours = jax.grad(objective)(x + 0.1, target)
reference = jax.grad(objective_in_jax)(x + 0.1, target)
assert np.allclose(ours, reference, rtol=1e-5, atol=1e-6), (ours, reference)
hessian = jax.hessian(lambda v: objective(v.reshape(1, 2), target))(x.ravel() + 0.1)
assert np.allclose(hessian, jax.hessian(lambda v: objective_in_jax(v.reshape(1, 2), target))(x.ravel() + 0.1),
                   rtol=1e-4, atol=1e-5)
batch = jax.vmap(jax.grad(lambda v: objective(v[None], target)))(jnp.linspace(-1, 1, 8).reshape(4, 2))
print("gradient matches the all-JAX network; hessian", hessian.shape, "and a vmapped batch", batch.shape, "too")

# Annotations pass data as data: the target below is a Constant, never differentiated.
loss = ad.differentiate_with(lambda x, t: torch.sum((model(x) - t) ** 2), ad.AutoTorch())
print("d loss / d target is zero:", jax.grad(lambda x, t: loss(x, Constant(t)), argnums=1)(x, target))

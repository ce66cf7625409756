"""The same training loop in JAX with an Equinox model: the gradient is an Equinox module.

`prepare` compiles value_and_gradient once; every step passes new data of the same
shape, which never recompiles.
"""

import equinox as eqx
import jax
import jax.numpy as jnp

import activity as ad
from activity import Active, Constant

model = eqx.nn.MLP(in_size=2, out_size=1, width_size=16, depth=1, activation=jnp.tanh, key=jax.random.PRNGKey(0))


def loss(model, batch):
    x, y = batch
    prediction = jax.vmap(model)(x)[:, 0]
    return jnp.mean((prediction - y) ** 2)


def make_batch(step: int) -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(jax.random.PRNGKey(step), (64, 2))
    return x, jnp.sin(x[:, 0]) * x[:, 1]


step_fn = ad.prepare(ad.value_and_gradient, loss, Active(model), Constant(make_batch(0)))
learning_rate = 0.2
for step in range(101):
    value, grads = step_fn(model, make_batch(step))
    # grads is an eqx.nn.MLP like `model`, with None at non-float fields (the activation);
    # eqx.apply_updates skips those None leaves
    model = eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -learning_rate * g, grads))
    if step % 25 == 0:
        print(f"step {step:3d}  loss {float(value):.4f}")

print("gradient type:", type(grads).__name__)

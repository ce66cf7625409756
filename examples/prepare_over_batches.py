"""`prepare` once, then call the prepared gradient on every batch (PyTorch and JAX).

Preparation builds the transformed function (and, on JAX, compiles it); later
calls take raw values in the prepared kinds. A batch of another shape is a
PreparationMismatchError unless strict=False.
"""

import time

import jax
import jax.numpy as jnp
import torch

import activity as ad
from activity import Active, Constant

# PyTorch: a linear model, the batch as a Constant.
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
loss = lambda model, x: model(x).pow(2).mean()  # noqa: E731
batches = [torch.randn(32, 8) for _ in range(50)]
prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(batches[0]))
start = time.perf_counter()
norms = [prepared(model, x)["weight"].norm().item() for x in batches]
print(f"torch: {len(batches)} prepared gradients in {1e3 * (time.perf_counter() - start):.1f} ms; "
      f"first |dW| = {norms[0]:.4f}, last = {norms[-1]:.4f}")

try:
    prepared(model, torch.randn(16, 8))
except ad.PreparationMismatchError as error:
    print("batch of 16 rows:", type(error).__name__, "-", str(error).splitlines()[0])

# JAX: compiled once in prepare; new data of the same shape never recompiles.
w = jnp.ones(8)
jloss = lambda w, x: jnp.mean((x @ w) ** 2)  # noqa: E731
keys = jax.random.split(jax.random.PRNGKey(0), 50)
xs = [jax.random.normal(k, (32, 8)) for k in keys]
jprepared = ad.prepare(ad.gradient, jloss, Active(w), Constant(xs[0]))
start = time.perf_counter()
grads = [jprepared(w, x) for x in xs]
jax.block_until_ready(grads)
print(f"jax:   {len(xs)} prepared gradients in {1e3 * (time.perf_counter() - start):.1f} ms; "
      f"matches jax.grad: {bool(jnp.allclose(grads[-1], jax.grad(jloss)(w, xs[-1])))}")

# strict=False: a new shape re-prepares instead of raising.
lenient = ad.prepare(ad.gradient, jloss, Active(w), Constant(xs[0]), strict=False)
print("strict=False, batch of 16 rows:", lenient(w, xs[0][:16]).shape)

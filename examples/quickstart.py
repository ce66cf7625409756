"""The card example: gradient(loss, Active(params), Constant(x)) on JAX and on PyTorch.

Run with `make demo`, or `python examples/quickstart.py` where only one of the two is
installed: the other's example is skipped, with the command that installs it.
"""

import importlib

import numpy as np

import activity as ad
from activity import Active, Constant


def jax_example() -> None:
    import jax
    import jax.numpy as jnp

    def loss(params, x, y):
        prediction = jnp.tanh(x @ params["w"] + params["b"])
        return jnp.mean((prediction - y) ** 2)

    key_w, key_x = jax.random.split(jax.random.PRNGKey(0))
    params = {"w": 0.5 * jax.random.normal(key_w, (3,)), "b": jnp.array(0.1), "name": "linear"}
    x = jax.random.normal(key_x, (8, 3))
    y = jnp.ones(8)

    grads = ad.gradient(loss, Active(params), Constant(x), Constant(y))
    print("JAX: gradient(loss, Active(params), Constant(x), Constant(y))")
    for name, g in grads.items():
        print(f"  d loss / d {name:<4} = {g}")

    reference = ad.gradient(loss, Active(params), Constant(x), Constant(y), backend=ad.AutoFiniteDifferences())
    err = max(float(jnp.max(jnp.abs(grads[k] - reference[k]))) for k in ("w", "b"))
    print(f"  max |AutoJAX - AutoFiniteDifferences| = {err:.1e}")

    step = ad.prepare(ad.value_and_gradient, loss, Active(params), Constant(x), Constant(y))
    for batch in range(3):  # new data every step, compiled once
        x = jax.random.normal(jax.random.PRNGKey(batch + 1), (8, 3))
        value, grads = step(params, x, y)
        params = {**params, "w": params["w"] - 0.5 * grads["w"], "b": params["b"] - 0.5 * grads["b"]}
        print(f"  prepared step {batch}: loss = {float(value):.4f}")


def torch_example() -> None:
    import torch

    generator = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=generator))
    x = torch.randn(8, 3, generator=generator)

    def loss(model, x):
        return model(x).pow(2).mean()

    grads = ad.gradient(loss, Active(model), Constant(x))
    print("PyTorch: gradient(loss, Active(model), Constant(x)) on nn.Sequential")
    for name, g in grads.items():
        print(f"  {name:<9} {tuple(g.shape)}  |g| = {g.norm():.4f}")
    untouched = all(p.grad is None for p in model.parameters())
    print(f"  model .grad untouched: {untouched}")
    reference = ad.gradient(loss, Active(model), Constant(x), backend=ad.AutoFiniteDifferences())
    err = max(float((grads[k] - reference[k]).abs().max()) for k in grads)
    print(f"  max |AutoTorch - AutoFiniteDifferences| = {err:.1e}")


def main() -> int:
    np.set_printoptions(precision=4)
    ran = 0
    for framework, example in (("jax", jax_example), ("torch", torch_example)):
        try:
            importlib.import_module(framework)
        except ImportError:
            print(f'{framework} is not installed: its example is skipped (pip install ".[{framework}]" from a clone)\n')
            continue
        example()
        print()
        ran += 1
    if not ran:
        print("Neither JAX nor PyTorch is installed: this example needs one of them.")
    return 0 if ran else 1


if __name__ == "__main__":
    raise SystemExit(main())

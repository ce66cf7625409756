"""Newton's method with `hessian` and `gradient` on the Rosenbrock function (JAX)."""

import jax

jax.config.update("jax_enable_x64", True)  # Newton converges to machine precision in float64

import jax.numpy as jnp  # noqa: E402

import activity as ad  # noqa: E402
from activity import Active, Constant  # noqa: E402


def rosenbrock(x, a):
    return (a - x[0]) ** 2 + 100.0 * (x[1] - x[0] ** 2) ** 2


a = jnp.array(1.0)
x = jnp.array([-1.2, 1.0])
for iteration in range(8):
    value, g, H = ad.value_gradient_and_hessian(rosenbrock, Active(x), Constant(a))
    print(f"iter {iteration}  f = {float(value):.3e}  |grad| = {float(jnp.linalg.norm(g)):.3e}")
    x = x - jnp.linalg.solve(H, g)
print("minimum found at", x, "(exact: [1. 1.])")

"""A SciPy ODE solver inside `jax.grad`: finite differences supply its derivatives.

`scipy.integrate.solve_ivp` is not JAX code, so JAX cannot differentiate it;
`differentiate_with(solve, AutoFiniteDifferences())` makes it a JAX function whose
derivatives come from float64 central differences. We fit the decay rate of
``dy/dt = -k y`` to an observation, and check the gradient against the closed form
``y(T) = y0 exp(-k T)``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import scipy.integrate

import activity as ad
from activity import Constant


def final_value(k, y0, t_end):
    """y(t_end) for dy/dt = -k y, y(0) = y0, solved by SciPy (numpy in, numpy out)."""
    solution = scipy.integrate.solve_ivp(lambda t, y: -k * y, (0.0, t_end), y0, rtol=1e-12, atol=1e-12,
                                         method="DOP853")
    return solution.y[:, -1]


solve = ad.differentiate_with(final_value, ad.AutoFiniteDifferences())
t_end, y0, observed = 2.0, jnp.array([1.0]), jnp.array([0.3])


def misfit(k):
    return jnp.sum((solve(k, Constant(y0), Constant(t_end)) - observed) ** 2)


gradient = jax.jit(jax.value_and_grad(misfit))
k = jnp.array([0.2])
for iteration in range(40):
    value, g = gradient(k)
    k = k - 2.0 * g
print(f"fitted k = {float(k[0]):.5f}; exact: {np.log(1 / 0.3) / t_end:.5f}")

# The closed form's derivative: d/dk (y0 e^{-kT} - obs)^2 = 2 (y - obs) (-T y).
k_test = np.array([0.7])
y = np.asarray(y0) * np.exp(-k_test * t_end)
exact = 2 * (y - np.asarray(observed)) * (-t_end * y)
ours = jax.grad(misfit)(jnp.asarray(k_test, dtype=jnp.float32))
assert np.allclose(ours, exact, rtol=1e-4, atol=1e-6), (ours, exact)
print("gradient through solve_ivp:", float(ours[0]), "closed form:", float(exact[0]))

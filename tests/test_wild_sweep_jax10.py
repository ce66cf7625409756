"""AutoJAX on the libraries users bring (round 10): a dataclass whose ``__post_init__`` sets
attributes (a jaxopt solver) as a Constant. Expected values come from ``jax.grad``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import jaxopt
import numpy as np

import activity as ad
from activity import Active, Constant


@dataclasses.dataclass(eq=False)
class Config:
    power: int

    def __post_init__(self):
        self.apply = lambda x: x**self.power  # set here, not a field


def test_a_dataclass_with_post_init_attributes_and_a_jaxopt_solver_as_constants():
    x = jnp.arange(3.0)
    config = Config(3)
    f = lambda x, c: jnp.sum(c.apply(x))  # noqa: E731
    np.testing.assert_allclose(ad.gradient(f, Active(x), Constant(config)), jax.grad(f)(x, config))
    np.testing.assert_allclose(ad.prepare(ad.gradient, f, Active(x), Constant(config))(2 * x, config), jax.grad(f)(2 * x, config))

    X, y = jax.random.normal(jax.random.key(0), (8, 3)), jax.random.normal(jax.random.key(1), (8,))
    ridge = lambda w, lam, X, y: 0.5 * jnp.sum((X @ w - y) ** 2) + 0.5 * lam * jnp.sum(w**2)  # noqa: E731
    solver = jaxopt.GradientDescent(fun=ridge, tol=1e-6, maxiter=100, stepsize=0.02, implicit_diff=True)
    outer = lambda lam, s, X, y: jnp.sum(s.run(jnp.zeros(3), lam, X, y).params)  # noqa: E731
    lam = jnp.array(0.5)
    np.testing.assert_allclose(ad.gradient(outer, Active(lam), Constant(solver), Constant(X), Constant(y)), jax.grad(outer)(lam, solver, X, y), rtol=1e-5)

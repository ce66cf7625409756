"""AutoJAX on the libraries users bring (round 10): a dataclass whose ``__post_init__`` sets
attributes (a jaxopt solver) as a Constant, a jraph graph as a Constant, a loss after optax steps.
Expected values come from ``jax.grad``."""

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


def test_a_jraph_graph_as_a_constant_takes_new_graphs_of_its_sizes_and_names_a_size_change():
    import jraph

    def graph(seed, n_node):
        key = jax.random.key(seed)
        senders = jnp.arange(n_node) % n_node
        receivers = (senders + 1) % n_node
        return jraph.GraphsTuple(
            nodes=jax.random.normal(key, (n_node, 3)), edges=None, senders=senders, receivers=receivers,
            n_node=jnp.array([n_node]), n_edge=jnp.array([n_node]), globals=None,
        )

    def loss(w, g):
        conv = jraph.GraphConvolution(update_node_fn=lambda h: jnp.tanh(h @ w), add_self_edges=True)
        return jnp.sum(conv(g).nodes ** 2)

    w = jax.random.normal(jax.random.key(9), (3, 2))
    first, second = graph(0, 5), graph(1, 5)
    prepared = ad.prepare(ad.gradient, loss, Active(w), Constant(first))
    for g in (first, second):  # a new graph of the same sizes is new data, never the first graph's result
        np.testing.assert_allclose(prepared(w, g), jax.grad(loss)(w, g), rtol=1e-6)
    with np.testing.assert_raises_regex(ad.PreparationMismatchError, r"\.nodes"):
        prepared(w, graph(2, 7))


def test_a_loss_after_optax_adam_steps_with_the_optimiser_state_as_a_constant():
    import optax

    optimiser = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(optax.warmup_cosine_decay_schedule(0.0, 0.1, 2, 10)))
    X, y = jax.random.normal(jax.random.key(0), (6, 3)), jax.random.normal(jax.random.key(1), (6,))
    inner = lambda p: jnp.mean((X @ p["w"] + p["b"] - y) ** 2)  # noqa: E731

    def after_two_steps(params, state):
        for _ in range(2):
            updates, state = optimiser.update(jax.grad(inner)(params), state, params)
            params = optax.apply_updates(params, updates)
        return inner(params)

    params = {"w": jnp.ones(3), "b": jnp.array(0.5)}
    state = optimiser.init(params)
    before = jax.tree.map(np.array, state)
    expected = jax.grad(after_two_steps)(params, state)
    got = ad.gradient(after_two_steps, Active(params), Constant(state))
    for key in params:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, atol=1e-7)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.array, state), before)  # the user's state is as it was

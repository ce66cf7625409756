"""Closure against Constant under `jax.jit`: a training-style loop over new batches.

Closure-based code differentiates ``lambda p: loss(p, x)``, a new function for
every batch, so `jax.jit` traces and compiles it again each time. With
``Constant(x)`` the data is an argument of one prepared function, compiled once.
A counter incremented inside the loss counts traces (its Python body only runs
while JAX traces it), which is also how often each side compiles.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import attrs
import jax
import jax.numpy as jnp
import numpy as np

import activity as ad
from activity import Active, Constant

from ._cases_jax import mlp, mlp_data, mlp_params

CLOSURE_TARGET = 20.0


@attrs.define
class TraceCounter:
    """Wraps a loss; ``count`` goes up by one each time JAX traces (or eagerly runs) it."""

    loss: Callable
    count: int = 0

    def __call__(self, params, x):
        self.count += 1
        return self.loss(params, x)


@attrs.frozen
class ClosureResult:
    batches: int
    width: int
    closure_s: float
    constant_s: float
    closure_traces: int
    constant_traces: int

    @property
    def speedup(self) -> float:
        return self.closure_s / self.constant_s


def _mse(params, x):
    return jnp.mean(mlp(params, x) ** 2)


def closure_loop(params, batches) -> tuple[list, int]:
    """A fresh ``jax.jit(jax.grad(lambda p: loss(p, x)))`` per batch; returns (gradients, traces)."""
    loss = TraceCounter(_mse)
    grads = []
    for x in batches:
        grads.append(jax.block_until_ready(jax.jit(jax.grad(lambda p, x=x: loss(p, x)))(params)))
    return grads, loss.count


def constant_loop(params, batches) -> tuple[list, int]:
    """One prepared gradient with ``Constant(x)``, called on every batch; returns (gradients, traces)."""
    loss = TraceCounter(_mse)
    prepared = ad.prepare(ad.gradient, loss, Active(params), Constant(batches[0]))
    grads = [jax.block_until_ready(prepared(params, x)) for x in batches]
    return grads, loss.count


def make_batches(width: int, count: int) -> list[jax.Array]:
    return [mlp_data(width, seed=1 + i) for i in range(count)]


def run(width: int = 64, batches: int = 50, repeats: int = 3, clock=time.perf_counter) -> ClosureResult:
    """Times both loops (preparation included) ``repeats`` times, alternately; medians of the totals.

    The parameters stay fixed so each loop does the same arithmetic; only the
    way the data reaches the derivative differs.
    """
    params, data = mlp_params(width), make_batches(width, batches)
    closure_times, constant_times, traces = [], [], (0, 0)
    for _ in range(repeats):
        start = clock()
        _, closure_traces = closure_loop(params, data)
        closure_times.append(clock() - start)
        start = clock()
        _, constant_traces = constant_loop(params, data)
        constant_times.append(clock() - start)
        traces = (closure_traces, constant_traces)
    return ClosureResult(
        batches=batches, width=width,
        closure_s=statistics.median(closure_times), constant_s=statistics.median(constant_times),
        closure_traces=traces[0], constant_traces=traces[1],
    )


def same_gradients(width: int = 4, batches: int = 3) -> None:
    """Both loops give the same gradients batch by batch (AssertionError otherwise)."""
    from activity.testing import assert_tree_allclose

    params, data = mlp_params(width), make_batches(width, batches)
    ours, _ = constant_loop(params, data)
    theirs, _ = closure_loop(params, data)
    assert_tree_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(ours[0]["w1"]), np.asarray(ours[-1]["w1"])), "batches should differ"

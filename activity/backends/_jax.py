"""JAX: `jax.jvp`, `jax.vjp`, `jax.vmap`, and `jax.jit` for prepared operators."""

from __future__ import annotations

import threading
from typing import Any, Callable

import attrs

from .._problem import combine, partition
from ._base import Backend, Flat, FlatFunction


def _jax() -> Any:
    import jax

    return jax


@attrs.frozen
class AutoJAX(Backend):
    """Differentiate with JAX transforms; prepared operators are compiled with `jax.jit`.

    Constants are traced arguments of the compiled function, so new data of
    the same shape and dtype never recompiles; non-array leaves are static.

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> ad.gradient(lambda w, x: jnp.sum((w * x) ** 2), ad.Active(jnp.ones(2)),
    ...             ad.Constant(jnp.array([1.0, 2.0])), backend=ad.AutoJAX())
    Array([2., 8.], dtype=float32)
    """

    framework = "jax"

    def as_array(self, leaf: Any) -> Any:
        return _jax().numpy.asarray(leaf) if isinstance(leaf, float) else leaf

    def as_tangent(self, leaf: Any, dtype: Any) -> Any:
        return _jax().numpy.asarray(leaf, dtype=dtype)

    def fresh_cache(self, leaf: Any, like: Any) -> Any:
        # JAX arrays are immutable: f writes with `.at[...].set(...)` and gets a traced array.
        jnp = _jax().numpy
        dtype = jnp.result_type(leaf, like) if like is not None else None
        return jnp.asarray(leaf, dtype=dtype)

    def jvp(self, F: FlatFunction, xs: Flat, ts: Flat, batched: bool) -> tuple[Flat, Any, Flat]:
        jax = _jax()

        def one(tangent: Flat) -> tuple:
            return jax.jvp(F, (xs,), (tangent,), has_aux=True)

        if not batched:
            ys, dys, aux = one(ts)
        else:
            ys, dys, aux = jax.vmap(one, out_axes=(None, 0, None))(ts)
        return ys, aux, dys

    def vjp(self, F: FlatFunction, xs: Flat) -> tuple[Flat, Any, Callable[[Flat, bool], Flat]]:
        jax = _jax()
        ys, pull_one, aux = jax.vjp(F, xs, has_aux=True)

        def pull(cts: Flat, batched: bool) -> Flat:
            if batched:
                return jax.vmap(lambda ct: pull_one(ct)[0])(cts)
            return pull_one(cts)[0]

        return ys, aux, pull

    def value_and_grad(self, F: FlatFunction, xs: Flat) -> tuple[Flat, Any, Flat]:
        def scalar(xs_: Flat) -> tuple[Any, tuple]:
            ys, aux = F(xs_)
            return ys[0], (ys, aux)

        (_, (ys, aux)), grads = _jax().value_and_grad(scalar, has_aux=True)(xs)
        return ys, aux, grads

    def compile(self, pipeline: Callable) -> Callable:
        jax = _jax()
        static_of_output: dict[str, Any] = {}
        lock = threading.Lock()

        def traced(xs: Flat, ctx: Flat, extra: Flat | None) -> list:
            dynamic, static = partition(pipeline(xs, ctx, extra))
            with lock:
                static_of_output["static"] = static  # fixed for a plan: one signature, one structure
            return dynamic

        jitted = jax.jit(traced)

        def run(xs: Flat, ctx: Flat, extra: Flat | None) -> Any:
            dynamic = jitted(xs, ctx, extra)
            return combine(dynamic, static_of_output["static"])

        run.jitted = jitted  # type: ignore[attr-defined]
        return run

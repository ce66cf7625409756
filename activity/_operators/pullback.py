"""`pullback` and `value_and_pullback`: vector-Jacobian products (reverse mode)."""

from __future__ import annotations

from typing import Any, Callable

from .. import _arrays as arrays
from .._tree import leaf_paths
from .._annotations import Annotation
from ..backends import Backend
from ._common import Operator, call, per_seed, register, start


def _build(problem, f, backend, seeds, *, value: bool) -> Callable:
    batched = seeds.batch is not None

    def pipeline(xs, ctx, cts):
        xs, traced, F = start(problem, f, backend, xs, ctx)
        ys, _, pull = backend.vjp(F, xs)
        cts = _checked(problem, traced, seeds, cts, ys)
        grads = pull(cts, batched)
        result = per_seed(seeds, lambda b: problem.like_active(grads if b is None else [g[b] for g in grads]))
        return (traced.output(ys), result) if value else result

    return pipeline


def _checked(problem, traced, seeds, cts, ys) -> tuple:
    what = "cotangent" if seeds.batch is None else "cotangents[i]"
    if seeds.spec != traced.out_spec:
        raise ValueError(
            f"activity.{problem.op_name}: {what} must have the structure of f's output: expected "
            f"{traced.out_spec}, got {seeds.spec}."
        )
    lead = () if seeds.batch is None else (seeds.batch,)
    for index, (ct, y) in enumerate(zip(cts, ys)):
        if arrays.shape(ct) != lead + arrays.shape(y):
            path = leaf_paths(traced.output(list(range(len(ys)))))[index]
            raise ValueError(
                f"activity.{problem.op_name}: {what}{path} has shape {arrays.shape(ct)[len(lead):]}, "
                f"but f's output there has shape {arrays.shape(y)}. Pass a cotangent shaped like f's output."
            )
    return tuple(problem.backend.as_tangent(ct, y.dtype) for ct, y in zip(cts, ys))


def pullback(
    f: Callable, *args: Annotation, backend: Backend | None = None, cotangent: Any = None, cotangents: Any = None, **keywords: Annotation
) -> Any:
    """The cotangent pulled back to the Active arguments (a VJP), or a list for ``cotangents=[...]``.

    A cotangent has the structure of ``f``'s output; the result has the
    structure of the Active argument(s).

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> ad.pullback(lambda x: x**2, ad.Active(jnp.array([1.0, 2.0])), cotangent=jnp.array([1.0, 1.0]))
    Array([2., 4.], dtype=float32)
    """
    return call(PULLBACK, f, args, backend, {}, {"cotangent": cotangent, "cotangents": cotangents}, keywords)


def value_and_pullback(
    f: Callable, *args: Annotation, backend: Backend | None = None, cotangent: Any = None, cotangents: Any = None, **keywords: Annotation
) -> tuple[Any, Any]:
    """``(value, pullback)``.

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> ad.value_and_pullback(lambda x: 2 * x, ad.Active(jnp.array(1.0)), cotangent=jnp.array(3.0))
    (Array(2., dtype=float32, weak_type=True), Array(6., dtype=float32))
    """
    return call(VALUE_AND_PULLBACK, f, args, backend, {}, {"cotangent": cotangent, "cotangents": cotangents}, keywords)


PULLBACK = Operator("pullback", lambda *a: _build(*a, value=False), seed="cotangent")
VALUE_AND_PULLBACK = Operator("value_and_pullback", lambda *a: _build(*a, value=True), seed="cotangent")
register(PULLBACK, pullback)
register(VALUE_AND_PULLBACK, value_and_pullback)

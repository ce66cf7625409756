"""`pushforward` and `value_and_pushforward`: Jacobian-vector products (forward mode)."""

from __future__ import annotations

from typing import Any, Callable, overload, Sequence

from .._annotations import Annotation
from .._problem import Problem
from ..backends import Backend
from ._common import call, Operator, per_seed, register, Seeds, start
from ._typing import R


def _build(
    problem: Problem, f: Callable[..., Any], backend: Backend, seeds: Seeds, *, value: bool
) -> Callable[..., Any]:
    def pipeline(xs: tuple[Any, ...], ctx: tuple[Any, ...], ts: Any) -> Any:
        xs, traced, F = start(problem, f, backend, xs, ctx)
        ys, _, dys = backend.jvp(F, xs, ts, seeds.batch is not None)
        tangent_out = per_seed(seeds, lambda b: traced.output(dys if b is None else [d[b] for d in dys]))
        return (traced.output(ys), tangent_out) if value else tangent_out

    return pipeline


@overload
def pushforward(
    f: Callable[..., R], /, *args: Annotation[Any],
    backend: Backend | None = None, tangent: Any, tangents: None = None,
    **keywords: Annotation[Any],
) -> R: ...
@overload
def pushforward(
    f: Callable[..., R], /, *args: Annotation[Any],
    backend: Backend | None = None, tangent: None = None, tangents: Sequence[Any],
    **keywords: Annotation[Any],
) -> list[R]: ...
@overload
def pushforward(
    f: Callable[..., R], /, *args: Annotation[Any],
    backend: Backend | None = None, tangent: Any = None, tangents: Any = None,
    **keywords: Annotation[Any],
) -> Any: ...
def pushforward(
    f: Callable[..., Any], /, *args: Annotation[Any], backend: Backend | None = None, tangent: Any = None, tangents: Any = None,
    **keywords: Annotation[Any],
) -> Any:
    """The output tangent of ``f`` along ``tangent`` (a JVP), or a list for ``tangents=[...]``.

    A tangent has the structure of the Active argument (a tuple of them when
    there are several); a batch is computed in one vectorised call where the
    backend can.

    Args:
        f: the function, called as ``f(*values)`` with the value inside each annotation.
        *args: the arguments of ``f`` in order, each wrapped in `Active` (differentiated),
            `Constant` (data) or `Cache` (scratch space ``f`` may overwrite).
        backend: `AutoJAX`, `AutoTorch`, `AutoFiniteDifferences` or `SecondOrder`; ``None``
            infers JAX or torch from the arguments.
        tangent: one tangent, of the structure of the Active argument (a tuple of them for
            several Active arguments).
        tangents: a list of tangents instead, computed in one batched call where the backend can.
        **keywords: keyword arguments for ``f``, each annotated like ``*args`` and passed by name
            (``scale=Constant(2.0)`` calls ``f(..., scale=2.0)``); Active ones come after the
            positional Actives in the result.

    Returns:
        The output tangent, of the structure of ``f``'s output; a list of them for ``tangents=``.

    Raises:
        TypeError: an argument is not annotated, no argument is Active, or no backend can be
            inferred (numpy values alone, or JAX and torch mixed).
        TypeError: neither or both of ``tangent=`` and ``tangents=`` are given.
        ValueError: a tangent's structure or shapes differ from the Active arguments'.
        UnsupportedError: ``backend`` does not support this operator with these annotation kinds
            (see `Backend.supports`).

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> ad.pushforward(lambda x: x**2, ad.Active(jnp.array([1.0, 2.0])), tangent=jnp.array([1.0, 0.0]))
    Array([2., 0.], dtype=float32)
    """
    return call(PUSHFORWARD, f, args, backend, {}, {"tangent": tangent, "tangents": tangents}, keywords)


@overload
def value_and_pushforward(
    f: Callable[..., R], /, *args: Annotation[Any],
    backend: Backend | None = None, tangent: Any, tangents: None = None,
    **keywords: Annotation[Any],
) -> tuple[R, R]: ...
@overload
def value_and_pushforward(
    f: Callable[..., R], /, *args: Annotation[Any],
    backend: Backend | None = None, tangent: None = None, tangents: Sequence[Any],
    **keywords: Annotation[Any],
) -> tuple[R, list[R]]: ...
@overload
def value_and_pushforward(
    f: Callable[..., R], /, *args: Annotation[Any],
    backend: Backend | None = None, tangent: Any = None, tangents: Any = None,
    **keywords: Annotation[Any],
) -> tuple[R, Any]: ...
def value_and_pushforward(
    f: Callable[..., Any], /, *args: Annotation[Any], backend: Backend | None = None, tangent: Any = None, tangents: Any = None, **keywords: Annotation[Any]
) -> Any:
    """``(value, pushforward)``.

    Args:
        f: the function, called as ``f(*values)`` with the value inside each annotation.
        *args: the arguments of ``f`` in order, each wrapped in `Active` (differentiated),
            `Constant` (data) or `Cache` (scratch space ``f`` may overwrite).
        backend: `AutoJAX`, `AutoTorch`, `AutoFiniteDifferences` or `SecondOrder`; ``None``
            infers JAX or torch from the arguments.
        tangent: one tangent, of the structure of the Active argument (a tuple of them for
            several Active arguments).
        tangents: a list of tangents instead, computed in one batched call where the backend can.
        **keywords: keyword arguments for ``f``, each annotated like ``*args`` and passed by name
            (``scale=Constant(2.0)`` calls ``f(..., scale=2.0)``); Active ones come after the
            positional Actives in the result.

    Returns:
        ``(value, pushforward)``.

    Raises:
        TypeError: an argument is not annotated, no argument is Active, or no backend can be
            inferred (numpy values alone, or JAX and torch mixed).
        TypeError: neither or both of ``tangent=`` and ``tangents=`` are given.
        ValueError: a tangent's structure or shapes differ from the Active arguments'.
        UnsupportedError: ``backend`` does not support this operator with these annotation kinds
            (see `Backend.supports`).

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> ad.value_and_pushforward(jnp.sin, ad.Active(jnp.array(0.0)), tangents=[jnp.array(2.0)])
    (Array(0., dtype=float32, weak_type=True), [Array(2., dtype=float32, weak_type=True)])
    """
    return call(VALUE_AND_PUSHFORWARD, f, args, backend, {}, {"tangent": tangent, "tangents": tangents}, keywords)


PUSHFORWARD = Operator("pushforward", lambda *a: _build(*a, value=False), seed="tangent")
VALUE_AND_PUSHFORWARD = Operator("value_and_pushforward", lambda *a: _build(*a, value=True), seed="tangent")
register(PUSHFORWARD, pushforward)
register(VALUE_AND_PUSHFORWARD, value_and_pushforward)

"""`second_derivative` and `value_derivative_and_second_derivative`: forward over forward."""

from __future__ import annotations

from typing import Any, Callable, overload

from .._annotations import Active, Annotation
from .._problem import Problem
from ..backends import Backend
from .._arrays import input_basis
from ._common import call, Operator, register, Seeds, start
from ._typing import Data, R


def _build(
    problem: Problem, f: Callable[..., Any], backend: Backend, seeds: Seeds | None, *, value: bool
) -> Callable[..., Any]:
    n = len(problem.diff_shapes)

    def pipeline(xs: tuple[Any, ...], ctx: tuple[Any, ...], extra: Any) -> Any:
        xs, traced, F = start(problem, f, backend, xs, ctx)
        ys, dys, _, d2ys = backend.value_and_second_jvp(F, xs, input_basis(xs, backend))

        def at(leaves: Any, *index: int) -> Any:
            return traced.output([leaf[index] for leaf in leaves])

        second = problem.like_active(
            [problem.like_active([at(d2ys, k, l) for l in range(n)]) for k in range(n)]
        )
        if not value:
            return second
        return traced.output(ys), problem.like_active([at(dys, k) for k in range(n)]), second

    return pipeline


@overload
def second_derivative(
    f: Callable[..., R], arg: Active[Any], /, *args: Data, backend: Backend | None = None,
    **keywords: Data,
) -> R: ...
@overload
def second_derivative(
    f: Callable[..., R], arg1: Active[Any], arg2: Active[Any], /, *args: Data, backend: Backend | None = None,
    **keywords: Data,
) -> tuple[tuple[R, R], tuple[R, R]]: ...
@overload
def second_derivative(
    f: Callable[..., R], /, *args: Annotation[Any], backend: Backend | None = None,
    **keywords: Annotation[Any],
) -> Any: ...
def second_derivative(f: Callable[..., Any], /, *args: Annotation[Any], backend: Backend | None = None, **keywords: Annotation[Any]) -> Any:
    """Second derivative of ``f``'s output with respect to scalar Active arguments.

    With several Active scalars, a tuple of tuples (``[i][j]`` is d2/dxi dxj).

    Args:
        f: the function, called as ``f(*values)`` with the value inside each annotation.
        *args: the arguments of ``f`` in order, each wrapped in `Active` (differentiated),
            `Constant` (data) or `Cache` (scratch space ``f`` may overwrite).
        backend: `AutoJAX`, `AutoTorch`, `AutoFiniteDifferences` or `SecondOrder`; ``None``
            infers JAX or torch from the arguments.
        **keywords: keyword arguments for ``f``, each annotated like ``*args`` and passed by name
            (``scale=Constant(2.0)`` calls ``f(..., scale=2.0)``); Active ones come after the
            positional Actives in the result.

    Returns:
        The second derivative, of the structure of ``f``'s output; a tuple of tuples for several
        Active arguments.

    Raises:
        TypeError: an argument is not annotated, no argument is Active, or no backend can be
            inferred (numpy values alone, or JAX and torch mixed).
        ValueError: an Active argument is not a scalar.
        UnsupportedError: ``backend`` does not support this operator with these annotation kinds
            (see `Backend.supports`).

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> ad.second_derivative(lambda t: t**3, ad.Active(2.0), backend=ad.AutoJAX())
    Array(12., dtype=float32, weak_type=True)
    """
    return call(SECOND_DERIVATIVE, f, args, backend, {}, {}, keywords)


@overload
def value_derivative_and_second_derivative(
    f: Callable[..., R], arg: Active[Any], /, *args: Data, backend: Backend | None = None,
    **keywords: Data,
) -> tuple[R, R, R]: ...
@overload
def value_derivative_and_second_derivative(
    f: Callable[..., R], arg1: Active[Any], arg2: Active[Any], /, *args: Data, backend: Backend | None = None,
    **keywords: Data,
) -> tuple[R, tuple[R, R], tuple[tuple[R, R], tuple[R, R]]]: ...
@overload
def value_derivative_and_second_derivative(
    f: Callable[..., R], /, *args: Annotation[Any], backend: Backend | None = None,
    **keywords: Annotation[Any],
) -> tuple[R, Any, Any]: ...
def value_derivative_and_second_derivative(
    f: Callable[..., Any], /, *args: Annotation[Any], backend: Backend | None = None, **keywords: Annotation[Any]
) -> Any:
    """``(value, derivative, second_derivative)``.

    Args:
        f: the function, called as ``f(*values)`` with the value inside each annotation.
        *args: the arguments of ``f`` in order, each wrapped in `Active` (differentiated),
            `Constant` (data) or `Cache` (scratch space ``f`` may overwrite).
        backend: `AutoJAX`, `AutoTorch`, `AutoFiniteDifferences` or `SecondOrder`; ``None``
            infers JAX or torch from the arguments.
        **keywords: keyword arguments for ``f``, each annotated like ``*args`` and passed by name
            (``scale=Constant(2.0)`` calls ``f(..., scale=2.0)``); Active ones come after the
            positional Actives in the result.

    Returns:
        ``(value, derivative, second_derivative)``.

    Raises:
        TypeError: an argument is not annotated, no argument is Active, or no backend can be
            inferred (numpy values alone, or JAX and torch mixed).
        ValueError: an Active argument is not a scalar.
        UnsupportedError: ``backend`` does not support this operator with these annotation kinds
            (see `Backend.supports`).

    >>> import activity as ad
    >>> ad.value_derivative_and_second_derivative(lambda t: t**3, ad.Active(2.0), backend=ad.AutoJAX())
    (Array(8., dtype=float32, weak_type=True), Array(12., dtype=float32, weak_type=True), Array(12., dtype=float32, weak_type=True))
    """
    return call(VALUE_DERIVATIVE_AND_SECOND_DERIVATIVE, f, args, backend, {}, {}, keywords)


SECOND_DERIVATIVE = Operator("second_derivative", lambda *a: _build(*a, value=False), scalar_input=True)
VALUE_DERIVATIVE_AND_SECOND_DERIVATIVE = Operator(
    "value_derivative_and_second_derivative", lambda *a: _build(*a, value=True), scalar_input=True
)
register(SECOND_DERIVATIVE, second_derivative)
register(VALUE_DERIVATIVE_AND_SECOND_DERIVATIVE, value_derivative_and_second_derivative)

"""`jacobian` and `value_and_jacobian`: reverse mode when outputs are fewer than inputs, else forward."""

from __future__ import annotations

from typing import Any, Callable, Literal, overload

from .. import _arrays as arrays
from .._annotations import Active, Annotation
from .._problem import Problem
from ..backends import Backend
from .._arrays import input_basis, output_basis
from ._common import blocks, call, Operator, register, Seeds, start, with_value
from ._typing import A, AR, ArrayLike, Data, NNXModuleLike, R, TorchModuleLike


def _build(
    problem: Problem, f: Callable[..., Any], backend: Backend, seeds: Seeds | None, *, value: bool, has_aux: bool = False
) -> Callable[..., Any]:
    def pipeline(xs: tuple[Any, ...], ctx: tuple[Any, ...], extra: Any) -> Any:
        xs, traced, F = start(problem, f, backend, xs, ctx, has_aux=has_aux)
        in_shapes = [arrays.shape(x) for x in xs]
        in_sizes = [arrays.size(x) for x in xs]
        replay = backend.random_state()
        try:
            ys, aux, pull = backend.vjp(F, xs)
        except Exception as error:
            # An operation with a forward-mode rule only (a Pallas kernel, a custom_vmap function)
            # makes JAX refuse to linearise f, before its output sizes are known. Forward mode
            # is the mode an f with more outputs than inputs takes: only then, it answers.
            if not backend.forward_only(error):
                raise
            backend.restore_random_state(replay)
            try:
                ys, aux, columns = backend.jvp(F, xs, input_basis(xs, backend), True)
            except Exception:
                raise error from None
            out_sizes = [arrays.size(y) for y in ys]
            if not sum(out_sizes) > sum(in_sizes) > 0:
                raise error from None
            matrix = [blocks(c, in_sizes, in_shapes, arrays.shape(y), inner_first=True) for c, y in zip(columns, ys)]
            jac = traced.output([problem.like_active(row) for row in matrix])
            return with_value(value, traced.output(ys), has_aux, traced.aux(aux) if has_aux else None, jac)
        out_shapes = [arrays.shape(y) for y in ys]
        out_sizes = [arrays.size(y) for y in ys]
        if sum(out_sizes) == 0 or sum(in_sizes) == 0:  # nothing to differentiate: empty blocks
            matrix = [[arrays.zeros(o + i, y) for i in in_shapes] for o, y in zip(out_shapes, ys)]
        elif sum(out_sizes) <= sum(in_sizes):  # reverse: one pullback per output entry
            cts = tuple(backend.as_tangent(b, y.dtype) for b, y in zip(output_basis(ys), ys))
            rows = pull(cts, True)
            by_input = [blocks(r, out_sizes, out_shapes, s, inner_first=False) for r, s in zip(rows, in_shapes)]
            matrix = [[column[j] for column in by_input] for j in range(len(ys))]
        else:  # forward: one pushforward per input entry, a second evaluation drawing the same random numbers
            backend.restore_random_state(replay)
            ys, aux, columns = backend.jvp(F, xs, input_basis(xs, backend), True)
            matrix = [blocks(c, in_sizes, in_shapes, s, inner_first=True) for c, s in zip(columns, out_shapes)]
        jac = traced.output([problem.like_active(row) for row in matrix])
        aux = traced.aux(aux) if has_aux else None
        return with_value(value, traced.output(ys), has_aux, aux, jac)

    return pipeline


@overload
def jacobian(
    f: Callable[..., Any], arg: Active[TorchModuleLike | NNXModuleLike], /, *args: Data,
    backend: Backend | None = None, has_aux: bool = False,
    **keywords: Data,
) -> Any: ...
@overload
def jacobian(
    f: Callable[..., AR], arg: Active[ArrayLike | float], /, *args: Data,
    backend: Backend | None = None, has_aux: Literal[False] = False,
    **keywords: Data,
) -> AR: ...
@overload
def jacobian(
    f: Callable[..., tuple[AR, A]], arg: Active[ArrayLike | float], /, *args: Data,
    backend: Backend | None = None, has_aux: Literal[True],
    **keywords: Data,
) -> tuple[AR, A]: ...
@overload
def jacobian(
    f: Callable[..., Any], arg1: Active[TorchModuleLike | NNXModuleLike], arg2: Active[Any], /, *args: Data,
    backend: Backend | None = None, has_aux: bool = False,
    **keywords: Data,
) -> Any: ...
@overload
def jacobian(
    f: Callable[..., Any], arg1: Active[Any], arg2: Active[TorchModuleLike | NNXModuleLike], /, *args: Data,
    backend: Backend | None = None, has_aux: bool = False,
    **keywords: Data,
) -> Any: ...
@overload
def jacobian(
    f: Callable[..., AR], arg1: Active[ArrayLike | float], arg2: Active[ArrayLike | float], /, *args: Data,
    backend: Backend | None = None, has_aux: Literal[False] = False,
    **keywords: Data,
) -> tuple[AR, AR]: ...
@overload
def jacobian(
    f: Callable[..., tuple[AR, A]], arg1: Active[ArrayLike | float], arg2: Active[ArrayLike | float], /, *args: Data,
    backend: Backend | None = None, has_aux: Literal[True],
    **keywords: Data,
) -> tuple[tuple[AR, AR], A]: ...
@overload
def jacobian(
    f: Callable[..., Any], /, *args: Annotation[Any], backend: Backend | None = None, has_aux: bool = False, **keywords: Annotation[Any]
) -> Any: ...
def jacobian(f: Callable[..., Any], /, *args: Annotation[Any], backend: Backend | None = None, has_aux: bool = False, **keywords: Annotation[Any]) -> Any:
    """Jacobian of ``f`` in `jax.jacobian`'s layout: output structure, then input structure,
    each leaf of shape ``output_shape + input_shape``.

    Args:
        f: the function, called as ``f(*values)`` with the value inside each annotation.
        *args: the arguments of ``f`` in order, each wrapped in `Active` (differentiated),
            `Constant` (data) or `Cache` (scratch space ``f`` may overwrite).
        backend: `AutoJAX`, `AutoTorch`, `AutoFiniteDifferences` or `SecondOrder`; ``None``
            infers JAX or torch from the arguments.
        has_aux: ``f`` returns ``(output, aux)``; ``aux`` is passed through, not differentiated.
        **keywords: keyword arguments for ``f``, each annotated like ``*args`` and passed by name
            (``scale=Constant(2.0)`` calls ``f(..., scale=2.0)``); Active ones come after the
            positional Actives in the result.

    Returns:
        The Jacobian: ``f``'s output structure, then the Active argument's, each leaf of shape
        ``output_shape + input_shape``; ``(jacobian, aux)`` with ``has_aux=True``.

    Raises:
        TypeError: an argument is not annotated, no argument is Active, or no backend can be
            inferred (numpy values alone, or JAX and torch mixed).
        UnsupportedError: ``backend`` does not support this operator with these annotation kinds
            (see `Backend.supports`).

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> ad.jacobian(lambda x: x**2, ad.Active(jnp.array([1.0, 2.0])))
    Array([[2., 0.],
           [0., 4.]], dtype=float32)
    """
    return call(JACOBIAN, f, args, backend, {"has_aux": has_aux}, {}, keywords)


@overload
def value_and_jacobian(
    f: Callable[..., R], arg: Active[TorchModuleLike | NNXModuleLike], /, *args: Data,
    backend: Backend | None = None, has_aux: bool = False,
    **keywords: Data,
) -> tuple[R, Any]: ...
@overload
def value_and_jacobian(
    f: Callable[..., AR], arg: Active[ArrayLike | float], /, *args: Data,
    backend: Backend | None = None, has_aux: Literal[False] = False,
    **keywords: Data,
) -> tuple[AR, AR]: ...
@overload
def value_and_jacobian(
    f: Callable[..., tuple[AR, A]], arg: Active[ArrayLike | float], /, *args: Data,
    backend: Backend | None = None, has_aux: Literal[True],
    **keywords: Data,
) -> tuple[tuple[AR, A], AR]: ...
@overload
def value_and_jacobian(
    f: Callable[..., R], arg1: Active[TorchModuleLike | NNXModuleLike], arg2: Active[Any], /, *args: Data,
    backend: Backend | None = None, has_aux: bool = False,
    **keywords: Data,
) -> tuple[R, Any]: ...
@overload
def value_and_jacobian(
    f: Callable[..., R], arg1: Active[Any], arg2: Active[TorchModuleLike | NNXModuleLike], /, *args: Data,
    backend: Backend | None = None, has_aux: bool = False,
    **keywords: Data,
) -> tuple[R, Any]: ...
@overload
def value_and_jacobian(
    f: Callable[..., AR], arg1: Active[ArrayLike | float], arg2: Active[ArrayLike | float], /, *args: Data,
    backend: Backend | None = None, has_aux: Literal[False] = False,
    **keywords: Data,
) -> tuple[AR, tuple[AR, AR]]: ...
@overload
def value_and_jacobian(
    f: Callable[..., tuple[AR, A]], arg1: Active[ArrayLike | float], arg2: Active[ArrayLike | float], /, *args: Data,
    backend: Backend | None = None, has_aux: Literal[True],
    **keywords: Data,
) -> tuple[tuple[AR, A], tuple[AR, AR]]: ...
@overload
def value_and_jacobian(
    f: Callable[..., R], /, *args: Annotation[Any], backend: Backend | None = None, has_aux: bool = False, **keywords: Annotation[Any]
) -> tuple[R, Any]: ...
def value_and_jacobian(
    f: Callable[..., Any], /, *args: Annotation[Any], backend: Backend | None = None, has_aux: bool = False, **keywords: Annotation[Any]
) -> Any:
    """``(value, jacobian)``, or ``((value, aux), jacobian)`` with ``has_aux=True``.

    Args:
        f: the function, called as ``f(*values)`` with the value inside each annotation.
        *args: the arguments of ``f`` in order, each wrapped in `Active` (differentiated),
            `Constant` (data) or `Cache` (scratch space ``f`` may overwrite).
        backend: `AutoJAX`, `AutoTorch`, `AutoFiniteDifferences` or `SecondOrder`; ``None``
            infers JAX or torch from the arguments.
        has_aux: ``f`` returns ``(output, aux)``; ``aux`` is passed through, not differentiated.
        **keywords: keyword arguments for ``f``, each annotated like ``*args`` and passed by name
            (``scale=Constant(2.0)`` calls ``f(..., scale=2.0)``); Active ones come after the
            positional Actives in the result.

    Returns:
        ``(value, jacobian)``, or ``((value, aux), jacobian)`` with ``has_aux=True``.

    Raises:
        TypeError: an argument is not annotated, no argument is Active, or no backend can be
            inferred (numpy values alone, or JAX and torch mixed).
        UnsupportedError: ``backend`` does not support this operator with these annotation kinds
            (see `Backend.supports`).

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> value, jac = ad.value_and_jacobian(lambda x: 3 * x, ad.Active(jnp.array([1.0])))
    >>> value, jac
    (Array([3.], dtype=float32), Array([[3.]], dtype=float32))
    """
    return call(VALUE_AND_JACOBIAN, f, args, backend, {"has_aux": has_aux}, {}, keywords)


JACOBIAN = Operator("jacobian", lambda *a, **k: _build(*a, value=False, **k))
VALUE_AND_JACOBIAN = Operator("value_and_jacobian", lambda *a, **k: _build(*a, value=True, **k))
register(JACOBIAN, jacobian)
register(VALUE_AND_JACOBIAN, value_and_jacobian)

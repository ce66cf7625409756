"""`gradient` and `value_and_gradient`: reverse mode on a scalar output."""

from __future__ import annotations

from typing import Any, Callable, Literal, overload

from .._annotations import Active, Annotation
from .._problem import Problem
from ..backends import Backend
from ._common import Operator, Seeds, call, register, start, with_value
from ._typing import A, Data, ModuleGradient, NNXGradient, NNXModuleLike, R, Special, T, T1, T2, T3, TorchModuleLike


def _build(
    problem: Problem, f: Callable[..., Any], backend: Backend, seeds: Seeds | None, *, value: bool, has_aux: bool = False
) -> Callable[..., Any]:
    def pipeline(xs: tuple[Any, ...], ctx: tuple[Any, ...], extra: Any) -> Any:
        xs, traced, F = start(problem, f, backend, xs, ctx, has_aux=has_aux, scalar=True)
        ys, aux, grads = backend.value_and_grad(F, xs)
        aux = traced.aux(aux) if has_aux else None
        return with_value(value, traced.output(ys) if value else None, has_aux, aux, problem.like_active(grads))

    return pipeline


@overload
def gradient(
    f: Callable[..., Any], arg: Active[TorchModuleLike], /, *args: Data,
    backend: Backend | None = None, has_aux: Literal[False] = False,
    **keywords: Data,
) -> ModuleGradient: ...
@overload
def gradient(
    f: Callable[..., Any], arg: Active[NNXModuleLike], /, *args: Data,
    backend: Backend | None = None, has_aux: Literal[False] = False,
    **keywords: Data,
) -> NNXGradient: ...
@overload
def gradient(
    f: Callable[..., tuple[Any, A]], arg: Active[TorchModuleLike], /, *args: Data,
    backend: Backend | None = None, has_aux: Literal[True],
    **keywords: Data,
) -> tuple[ModuleGradient, A]: ...
@overload
def gradient(
    f: Callable[..., tuple[Any, A]], arg: Active[NNXModuleLike], /, *args: Data,
    backend: Backend | None = None, has_aux: Literal[True],
    **keywords: Data,
) -> tuple[NNXGradient, A]: ...
@overload
def gradient(
    f: Callable[..., Any], arg: Active[float], /, *args: Data,
    backend: Backend | None = None, has_aux: Literal[False] = False,
    **keywords: Data,
) -> Any: ...
@overload
def gradient(
    f: Callable[..., tuple[Any, A]], arg: Active[float], /, *args: Data,
    backend: Backend | None = None, has_aux: Literal[True],
    **keywords: Data,
) -> tuple[Any, A]: ...
@overload
def gradient(
    f: Callable[..., Any], arg: Active[T], /, *args: Data,
    backend: Backend | None = None, has_aux: Literal[False] = False,
    **keywords: Data,
) -> T: ...
@overload
def gradient(
    f: Callable[..., tuple[Any, A]], arg: Active[T], /, *args: Data,
    backend: Backend | None = None, has_aux: Literal[True],
    **keywords: Data,
) -> tuple[T, A]: ...
@overload
def gradient(
    f: Callable[..., Any], arg1: Active[Special], arg2: Active[Any], /, *args: Data,
    backend: Backend | None = None, has_aux: bool = False,
    **keywords: Data,
) -> Any: ...
@overload
def gradient(
    f: Callable[..., Any], arg1: Active[Any], arg2: Active[Special], /, *args: Data,
    backend: Backend | None = None, has_aux: bool = False,
    **keywords: Data,
) -> Any: ...
@overload
def gradient(
    f: Callable[..., Any], arg1: Active[T1], arg2: Active[T2], /, *args: Data,
    backend: Backend | None = None, has_aux: Literal[False] = False,
    **keywords: Data,
) -> tuple[T1, T2]: ...
@overload
def gradient(
    f: Callable[..., tuple[Any, A]], arg1: Active[T1], arg2: Active[T2], /, *args: Data,
    backend: Backend | None = None, has_aux: Literal[True],
    **keywords: Data,
) -> tuple[tuple[T1, T2], A]: ...
@overload
def gradient(
    f: Callable[..., Any], arg1: Active[Special], arg2: Active[Any], arg3: Active[Any], /, *args: Data,
    backend: Backend | None = None, has_aux: bool = False,
    **keywords: Data,
) -> Any: ...
@overload
def gradient(
    f: Callable[..., Any], arg1: Active[Any], arg2: Active[Special], arg3: Active[Any], /, *args: Data,
    backend: Backend | None = None, has_aux: bool = False,
    **keywords: Data,
) -> Any: ...
@overload
def gradient(
    f: Callable[..., Any], arg1: Active[Any], arg2: Active[Any], arg3: Active[Special], /, *args: Data,
    backend: Backend | None = None, has_aux: bool = False,
    **keywords: Data,
) -> Any: ...
@overload
def gradient(
    f: Callable[..., Any], arg1: Active[T1], arg2: Active[T2], arg3: Active[T3], /, *args: Data,
    backend: Backend | None = None, has_aux: Literal[False] = False,
    **keywords: Data,
) -> tuple[T1, T2, T3]: ...
@overload
def gradient(
    f: Callable[..., tuple[Any, A]], arg1: Active[T1], arg2: Active[T2], arg3: Active[T3], /, *args: Data,
    backend: Backend | None = None, has_aux: Literal[True],
    **keywords: Data,
) -> tuple[tuple[T1, T2, T3], A]: ...
@overload
def gradient(f: Callable[..., Any], /, *args: Annotation[Any], backend: Backend | None = None, has_aux: bool = False, **keywords: Annotation[Any]) -> Any: ...
def gradient(f: Callable[..., Any], /, *args: Annotation[Any], backend: Backend | None = None, has_aux: bool = False, **keywords: Annotation[Any]) -> Any:
    """Gradient of a scalar ``f`` with respect to its Active arguments.

    One Active argument: a result of its structure; several: a tuple. A
    ``torch.nn.Module`` gives a dict keyed like ``named_parameters()``. With
    ``has_aux=True`` ``f`` returns ``(output, aux)`` and the result is ``(grad, aux)``.

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
        The gradient, of the structure of the Active argument (a dict keyed like
        ``named_parameters()`` for a module); a tuple for several Active arguments;
        ``(gradient, aux)`` with ``has_aux=True``.

    Raises:
        TypeError: an argument is not annotated, no argument is Active, or no backend can be
            inferred (numpy values alone, or JAX and torch mixed).
        ValueError: ``f`` does not return a scalar.
        UnsupportedError: ``backend`` does not support this operator with these annotation kinds
            (see `Backend.supports`).

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> loss = lambda params, x: jnp.sum((params["w"] * x + params["b"]) ** 2)
    >>> g = ad.gradient(loss, ad.Active({"w": jnp.array(1.0), "b": jnp.array(0.0)}),
    ...                 ad.Constant(jnp.array([1.0, 2.0])))
    >>> {k: float(v) for k, v in g.items()}
    {'w': 10.0, 'b': 6.0}
    """
    return call(GRADIENT, f, args, backend, {"has_aux": has_aux}, {}, keywords)


@overload
def value_and_gradient(
    f: Callable[..., R], arg: Active[TorchModuleLike], /, *args: Data, backend: Backend | None = None, has_aux: bool = False, **keywords: Data
) -> tuple[R, ModuleGradient]: ...
@overload
def value_and_gradient(
    f: Callable[..., R], arg: Active[NNXModuleLike], /, *args: Data, backend: Backend | None = None, has_aux: bool = False, **keywords: Data
) -> tuple[R, NNXGradient]: ...
@overload
def value_and_gradient(
    f: Callable[..., R], arg: Active[float], /, *args: Data, backend: Backend | None = None, has_aux: bool = False, **keywords: Data
) -> tuple[R, Any]: ...
@overload
def value_and_gradient(
    f: Callable[..., R], arg: Active[T], /, *args: Data, backend: Backend | None = None, has_aux: bool = False, **keywords: Data
) -> tuple[R, T]: ...
@overload
def value_and_gradient(
    f: Callable[..., R], arg1: Active[Special], arg2: Active[Any], /, *args: Data, backend: Backend | None = None, has_aux: bool = False,
    **keywords: Data,
) -> tuple[R, Any]: ...
@overload
def value_and_gradient(
    f: Callable[..., R], arg1: Active[Any], arg2: Active[Special], /, *args: Data, backend: Backend | None = None, has_aux: bool = False,
    **keywords: Data,
) -> tuple[R, Any]: ...
@overload
def value_and_gradient(
    f: Callable[..., R], arg1: Active[T1], arg2: Active[T2], /, *args: Data, backend: Backend | None = None, has_aux: bool = False,
    **keywords: Data,
) -> tuple[R, tuple[T1, T2]]: ...
@overload
def value_and_gradient(
    f: Callable[..., R], arg1: Active[Special], arg2: Active[Any], arg3: Active[Any], /, *args: Data, backend: Backend | None = None,
    has_aux: bool = False, **keywords: Data,
) -> tuple[R, Any]: ...
@overload
def value_and_gradient(
    f: Callable[..., R], arg1: Active[Any], arg2: Active[Special], arg3: Active[Any], /, *args: Data, backend: Backend | None = None,
    has_aux: bool = False, **keywords: Data,
) -> tuple[R, Any]: ...
@overload
def value_and_gradient(
    f: Callable[..., R], arg1: Active[Any], arg2: Active[Any], arg3: Active[Special], /, *args: Data, backend: Backend | None = None,
    has_aux: bool = False, **keywords: Data,
) -> tuple[R, Any]: ...
@overload
def value_and_gradient(
    f: Callable[..., R], arg1: Active[T1], arg2: Active[T2], arg3: Active[T3], /, *args: Data, backend: Backend | None = None,
    has_aux: bool = False, **keywords: Data,
) -> tuple[R, tuple[T1, T2, T3]]: ...
@overload
def value_and_gradient(
    f: Callable[..., R], /, *args: Annotation[Any], backend: Backend | None = None, has_aux: bool = False, **keywords: Annotation[Any]
) -> tuple[R, Any]: ...
def value_and_gradient(
    f: Callable[..., Any], /, *args: Annotation[Any], backend: Backend | None = None, has_aux: bool = False, **keywords: Annotation[Any]
) -> Any:
    """``(value, gradient)``, or ``((value, aux), gradient)`` with ``has_aux=True``.

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
        ``(value, gradient)``, or ``((value, aux), gradient)`` with ``has_aux=True``.

    Raises:
        TypeError: an argument is not annotated, no argument is Active, or no backend can be
            inferred (numpy values alone, or JAX and torch mixed).
        ValueError: ``f`` does not return a scalar.
        UnsupportedError: ``backend`` does not support this operator with these annotation kinds
            (see `Backend.supports`).

    >>> import jax.numpy as jnp
    >>> import activity as ad
    >>> ad.value_and_gradient(lambda x: jnp.sum(x**2), ad.Active(jnp.array([1.0, 2.0])))
    (Array(5., dtype=float32), Array([2., 4.], dtype=float32))
    """
    return call(VALUE_AND_GRADIENT, f, args, backend, {"has_aux": has_aux}, {}, keywords)


GRADIENT = Operator("gradient", lambda *a, **k: _build(*a, value=False, **k))
VALUE_AND_GRADIENT = Operator("value_and_gradient", lambda *a, **k: _build(*a, value=True, **k))
register(GRADIENT, gradient)
register(VALUE_AND_GRADIENT, value_and_gradient)

"""`SecondOrder(outer, inner)`: differentiate one backend's derivatives with another."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import attrs

from .._errors import short_repr
from .._operators._names import SECOND_ORDER
from ._base import Backend, Flat, FlatFunction
from ._finite_differences import AutoFiniteDifferences
from ._torch import AutoTorch


def _is_backend(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, Backend) or isinstance(value, SecondOrder):
        raise TypeError(
            f"SecondOrder({attribute.name}=...) must be a first-order backend such as AutoJAX(), "
            f"AutoTorch() or AutoFiniteDifferences(); got {short_repr(value)}."
        )


_MODES = ("forward-over-reverse", "reverse-over-reverse")


def _is_mode(instance: Any, attribute: Any, value: Any) -> None:
    if value not in _MODES:
        raise ValueError(f"SecondOrder(mode={value!r}): choose {' or '.join(map(repr, _MODES))}.")


@attrs.frozen
class SecondOrder(Backend):
    """Second-order operators as ``outer`` differentiating ``inner``'s first derivatives.

    First-order operators run on ``inner``, in the precision ``outer`` evaluates in
    (float64 for finite differences, modules included). An AD ``outer`` cannot differentiate
    through finite differences, so ``inner=AutoFiniteDifferences()`` needs
    ``outer=AutoFiniteDifferences()``. ``mode`` says how ``outer`` differentiates the
    gradient in `hvp` and `hessian`: along the tangents (``"forward-over-reverse"``) or
    pulling them back (``"reverse-over-reverse"``; the Hessian is symmetric).

    Args:
        outer: the backend that differentiates the first derivatives.
        inner: the backend that computes them (and every first-order operator).
        mode: ``"forward-over-reverse"`` or ``"reverse-over-reverse"``.

    Raises:
        TypeError: ``outer`` or ``inner`` is not a first-order backend.
        ValueError: ``mode`` is not one of the two.

    >>> import numpy as np
    >>> import activity as ad
    >>> backend = ad.SecondOrder(ad.AutoFiniteDifferences(), ad.AutoFiniteDifferences())
    >>> np.round(ad.second_derivative(np.sin, ad.Active(np.pi / 2), backend=backend), 6)
    np.float64(-1.0)
    """

    outer: Backend = attrs.field(validator=_is_backend)
    inner: Backend = attrs.field(validator=_is_backend)
    mode: str = attrs.field(default="forward-over-reverse", validator=_is_mode)

    def supports(self, operator: str, kind: str, mode: str = "unprepared") -> bool:
        if operator not in SECOND_ORDER:
            return self.inner.supports(operator, kind, mode)
        ad_over_fd = isinstance(self.inner, AutoFiniteDifferences) and not isinstance(self.outer, AutoFiniteDifferences)
        return not ad_over_fd and self.outer.supports(operator, kind, mode) and self.inner.supports(operator, kind, mode)

    @property
    def framework(self) -> str | None:  # type: ignore[override]
        return self.inner.framework or self.outer.framework

    def check_framework(self, op_name: str, framework: str | None, where: str) -> None:
        self.outer.check_framework(op_name, framework, where)
        self.inner.check_framework(op_name, framework, where)

    # Leaves are handled by the inner backend: it runs f.
    def as_array(self, leaf: Any) -> Any:
        return self.inner.as_array(leaf)

    def as_tangent(self, leaf: Any, dtype: Any) -> Any:
        return self.inner.as_tangent(leaf, dtype)

    def fresh_cache(self, leaf: Any, like: Any) -> Any:
        return self.inner.fresh_cache(leaf, like)

    def array_meta(self, leaf: Any) -> tuple[Any, ...]:
        return self.inner.array_meta(leaf)

    def cast_result(self, value: Any, dtype: Any) -> Any:
        return self.outer.cast_result(self.inner.cast_result(value, dtype), dtype)

    def describe_module(self, module: Any, previous: Any = None) -> Any:
        return self.inner.describe_module(module, previous)

    def bind_module(self, module: Any, params: list[Any] | None) -> Any:
        # In the precision the outer backend evaluates in: finite differences convert the
        # differentiated parameters to float64, so buffers and frozen parameters must be too.
        return self.outer.bind_module(module, params)

    # The outer backend owns precision and compilation of the whole pipeline.
    def context(self) -> contextlib.AbstractContextManager[Any]:
        stack = contextlib.ExitStack()
        stack.enter_context(self.outer.context())
        stack.enter_context(self.inner.context())
        return stack

    def explain_error(self, error: Exception, active: str) -> str | None:
        # f runs inside both backends' transforms: either may know the error
        return self.inner.explain_error(error, active) or self.outer.explain_error(error, active)

    def random_state(self) -> Any:
        return self.inner.random_state()  # the inner backend runs f

    def restore_random_state(self, state: Any) -> None:
        self.inner.restore_random_state(state)

    def convert_inputs(self, xs: Flat, ctx: Flat) -> tuple[Flat, Flat]:
        return self.outer.convert_inputs(*self.inner.convert_inputs(xs, ctx))

    def finalize(self, result: Any, problem: Any) -> Any:
        return self.outer.finalize(self.inner.finalize(result, problem), problem)

    def compile(self, pipeline: Callable[..., Any]) -> Callable[..., Any]:
        if type(self.outer) is type(self.inner):
            return self.outer.compile(pipeline)
        return pipeline

    def compile_call(self, plan: Any, values: tuple[Any, ...], seed_kwargs: dict[Any, Any], retrace: Callable[..., Any] | None = None) -> Any:
        if type(self.outer) is type(self.inner):
            return self.outer.compile_call(plan, values, seed_kwargs, retrace)
        return None

    # First-order primitives are the inner backend's.
    def jvp(self, F: FlatFunction, xs: Flat, ts: Flat, batched: bool) -> tuple[Flat, Any, Flat]:
        # A user's tangents were made in the inputs' dtype, before `convert_inputs` gave the
        # primals the outer backend's precision (float64 for finite differences).
        ts = tuple(self.inner.as_tangent(t, x.dtype) for t, x in zip(ts, xs))
        return self.inner.jvp(F, xs, ts, batched)

    def vjp(self, F: FlatFunction, xs: Flat) -> tuple[Flat, Any, Callable[[Flat, bool], Flat]]:
        return self.inner.vjp(F, xs)

    def value_and_grad(self, F: FlatFunction, xs: Flat) -> tuple[Flat, Any, Flat]:
        return self.inner.value_and_grad(F, xs)

    def value_and_hvp(self, F: FlatFunction, xs: Flat, ts: Flat, batched: bool) -> tuple[Flat, Flat, Any, Flat]:
        if self.mode == "forward-over-reverse":
            return super().value_and_hvp(F, xs, ts, batched)
        if type(self.outer) is type(self.inner) is AutoTorch:  # its own double backward on the tape
            return attrs.evolve(self.outer, hvp_mode="reverse-over-reverse").value_and_hvp(F, xs, ts, batched)
        grads, (ys, aux), pull = self.outer.vjp(self.inner.gradient_function(F), xs)
        return ys, grads, aux, pull(ts, batched)

"""`SecondOrder(outer, inner)`: differentiate one backend's derivatives with another."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import attrs

from .._operators._names import SECOND_ORDER
from ._base import Backend, Flat, FlatFunction
from ._finite_differences import AutoFiniteDifferences


def _is_backend(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, Backend) or isinstance(value, SecondOrder):
        raise TypeError(
            f"SecondOrder({attribute.name}=...) must be a first-order backend such as AutoJAX(), "
            f"AutoTorch() or AutoFiniteDifferences(); got {value!r:.60}."
        )


@attrs.frozen
class SecondOrder(Backend):
    """Second-order operators as ``outer`` differentiating ``inner``'s first derivatives.

    First-order operators run on ``inner``. An AD ``outer`` cannot differentiate
    through finite differences, so ``inner=AutoFiniteDifferences()`` needs
    ``outer=AutoFiniteDifferences()``.

    >>> import numpy as np
    >>> import activity as ad
    >>> backend = ad.SecondOrder(ad.AutoFiniteDifferences(), ad.AutoFiniteDifferences())
    >>> np.round(ad.second_derivative(np.sin, ad.Active(np.pi / 2), backend=backend), 6)
    np.float64(-1.0)
    """

    outer: Backend = attrs.field(validator=_is_backend)  # type: ignore[assignment]
    inner: Backend = attrs.field(validator=_is_backend)  # type: ignore[assignment]

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

    def array_meta(self, leaf: Any) -> tuple:
        return self.inner.array_meta(leaf)

    def cast_result(self, value: Any, dtype: Any) -> Any:
        return self.outer.cast_result(self.inner.cast_result(value, dtype), dtype)

    def describe_module(self, module: Any, previous: Any = None) -> Any:
        return self.inner.describe_module(module, previous)

    def bind_module(self, module: Any, params: list[Any] | None) -> Any:
        return self.inner.bind_module(module, params)

    # The outer backend owns precision and compilation of the whole pipeline.
    def context(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        stack.enter_context(self.outer.context())
        stack.enter_context(self.inner.context())
        return stack

    def convert_inputs(self, xs: Flat, ctx: Flat) -> tuple[Flat, Flat]:
        return self.outer.convert_inputs(*self.inner.convert_inputs(xs, ctx))

    def finalize(self, result: Any, problem: Any) -> Any:
        return self.outer.finalize(self.inner.finalize(result, problem), problem)

    def compile(self, pipeline: Callable) -> Callable:
        if type(self.outer) is type(self.inner):
            return self.outer.compile(pipeline)
        return pipeline

    def compile_call(self, plan: Any, values: tuple, seed_kwargs: dict, retrace: Callable | None = None) -> Any:
        if type(self.outer) is type(self.inner):
            return self.outer.compile_call(plan, values, seed_kwargs, retrace)
        return None

    # First-order primitives are the inner backend's.
    def jvp(self, F: FlatFunction, xs: Flat, ts: Flat, batched: bool) -> tuple[Flat, Any, Flat]:
        return self.inner.jvp(F, xs, ts, batched)

    def vjp(self, F: FlatFunction, xs: Flat) -> tuple[Flat, Any, Callable[[Flat, bool], Flat]]:
        return self.inner.vjp(F, xs)

    def value_and_grad(self, F: FlatFunction, xs: Flat) -> tuple[Flat, Any, Flat]:
        return self.inner.value_and_grad(F, xs)

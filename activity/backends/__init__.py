"""Backends: one module per framework behind the small protocol of `_base.Backend`."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

from .. import _arrays as arrays
from .._errors import short_repr
from .._problem import describe_type
from .._tree import flatten, leaf_paths
from ._base import Backend
from ._finite_differences import AutoFiniteDifferences
from ._jax import AutoJAX
from ._second_order import SecondOrder
from ._torch import AutoTorch

_CHOICES = "backend=AutoJAX(), backend=AutoTorch() or backend=AutoFiniteDifferences()"

# Set by `prepare` while it builds a plan from placeholders; everywhere else a placeholder
# among the arguments is a mistake (nothing can be computed from it).
_PLACEHOLDERS_ALLOWED: contextvars.ContextVar[bool] = contextvars.ContextVar("placeholders_allowed", default=False)


@contextlib.contextmanager
def placeholders_allowed() -> Iterator[None]:
    token = _PLACEHOLDERS_ALLOWED.set(True)
    try:
        yield
    finally:
        _PLACEHOLDERS_ALLOWED.reset(token)


def placeholders_are_allowed() -> bool:
    return _PLACEHOLDERS_ALLOWED.get()


def describe_placeholder(leaf: Any) -> str:
    if arrays.is_jax_placeholder(leaf):
        return f"a jax.ShapeDtypeStruct of shape {tuple(leaf.shape)} and dtype {leaf.dtype}"
    return f"a torch tensor on the meta device, of shape {tuple(leaf.shape)} and dtype {leaf.dtype}"


def find_placeholder(tree: Any, prefix: str) -> str | None:
    """Where the first placeholder in ``tree`` is, and what it is (for messages), or None."""
    leaves, _ = flatten(tree)
    for index, leaf in enumerate(leaves):
        if arrays.is_placeholder(leaf):
            return f"{prefix}{leaf_paths(tree)[index]} is {describe_placeholder(leaf)}"
    return None


def _frameworks(values: tuple[Any, ...]) -> tuple[dict[str, str], str | None]:
    """Framework -> where it first appears, and where the first placeholder is (for messages)."""
    found: dict[str, str] = {}
    placeholder = None
    for position, value in enumerate(values):
        leaves, _ = flatten(value)
        for index, leaf in enumerate(leaves):
            name = arrays.framework(leaf)
            # Checked only where a placeholder can be: a non-array or a torch tensor.
            jax_placeholder = name is None and arrays.is_jax_placeholder(leaf)
            if jax_placeholder or (name == "torch" and arrays.is_torch_placeholder(leaf)):
                name = name or "jax"
                if placeholder is None:
                    placeholder = f"argument {position}{leaf_paths(value)[index]} is {describe_placeholder(leaf)}"
            if name in ("jax", "torch") and name not in found:
                path = leaf_paths(value)[index] or ""
                found[name] = f"argument {position}{path}"
    return found, placeholder


def resolve_backend(op_name: str, backend: Any, values: tuple[Any, ...]) -> Backend:
    """``backend`` checked, or inferred from the arrays in ``values`` (placeholders count as
    arrays of their framework)."""
    found, placeholder = _frameworks(values)
    if placeholder is not None and not _PLACEHOLDERS_ALLOWED.get():
        raise TypeError(
            f"activity.{op_name}: {placeholder}. Placeholders stand in for data only when preparing "
            f"(activity.prepare(activity.{op_name}, f, ...) compiles from their shapes and dtypes); "
            f"nothing can be computed from them. Pass arrays here."
        )
    if backend is not None:
        if isinstance(backend, type) and issubclass(backend, Backend):
            raise TypeError(
                f"activity.{op_name}: backend must be a backend object such as {_CHOICES}; got the class "
                f"{backend.__name__} itself: pass backend={backend.__name__}()."
            )
        if not isinstance(backend, Backend):
            raise TypeError(
                f"activity.{op_name}: backend must be a backend object such as {_CHOICES}; "
                f"got {describe_type(backend)} {short_repr(backend)}."
            )
        for name, where in found.items():
            backend.check_framework(op_name, name, where)
        return backend
    if len(found) > 1:
        raise TypeError(
            f"activity.{op_name}: arguments mix frameworks: torch at {found['torch']} and JAX at "
            f"{found['jax']}. Convert them to one framework."
        )
    if "torch" in found:
        return AutoTorch()
    if "jax" in found:
        return AutoJAX()
    raise TypeError(
        f"activity.{op_name}: cannot infer a backend from numpy arrays and Python numbers alone. "
        f"Pass {_CHOICES}."
    )


__all__ = ["Backend", "AutoJAX", "AutoTorch", "AutoFiniteDifferences", "SecondOrder", "resolve_backend"]

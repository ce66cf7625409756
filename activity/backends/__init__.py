"""Backends: one module per framework behind the small protocol of `_base.Backend`."""

from __future__ import annotations

from typing import Any

from .. import _arrays as arrays
from .._tree import flatten, leaf_paths
from ._base import Backend
from ._finite_differences import AutoFiniteDifferences
from ._jax import AutoJAX
from ._second_order import SecondOrder
from ._torch import AutoTorch

_CHOICES = "backend=AutoJAX(), backend=AutoTorch() or backend=AutoFiniteDifferences()"


def _frameworks(values: tuple[Any, ...]) -> dict[str, str]:
    """Framework -> where it first appears (for messages)."""
    found: dict[str, str] = {}
    for position, value in enumerate(values):
        leaves, _ = flatten(value)
        for index, leaf in enumerate(leaves):
            name = arrays.framework(leaf)
            if name in ("jax", "torch") and name not in found:
                path = leaf_paths(value)[index] or ""
                found[name] = f"argument {position}{path}"
    return found


def resolve_backend(op_name: str, backend: Any, values: tuple[Any, ...]) -> Backend:
    """``backend`` checked, or inferred from the arrays in ``values``."""
    if backend is not None:
        if not isinstance(backend, Backend):
            raise TypeError(
                f"activity.{op_name}: backend must be a backend object such as {_CHOICES}; "
                f"got {type(backend).__name__} {backend!r:.60}."
            )
        for name, where in _frameworks(values).items():
            backend.check_framework(op_name, name, where)
        return backend
    found = _frameworks(values)
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

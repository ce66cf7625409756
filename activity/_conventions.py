"""What each model library calls a parameter, in one place, consulted by the argument parser.

- Any pytree (dicts, dataclasses, Equinox modules, ...): floating arrays are
  differentiated. A Python number inside a pytree is a static hyper-parameter,
  never differentiated (``None`` in the result), as ``eqx.filter_grad`` treats
  ``eqx.nn.Dropout.p``; only a whole argument ``Active(2.0)`` is a number to
  differentiate. Wrap a number with ``jnp.asarray`` / ``torch.tensor`` to
  differentiate it inside a pytree.
- A Flax NNX module: its ``nnx.Param`` variables, as ``nnx.grad`` differentiates
  by default; a variable shared by two submodules (tied weights) is one
  parameter. The result is the ``nnx.State`` of those parameters (what
  ``nnx.Optimizer(model, tx, wrt=nnx.Param).update(model, grads)`` takes), and
  ``f`` gets a copy of the module rebuilt from its state on every call, so what
  ``f`` changes in it (BatchNorm statistics, RNG counts) never reaches the user's.
- A torch module: its parameters with ``requires_grad=True``; the torch backend's
  module descriptions (`backends._torch_modules`) implement it.
"""

from __future__ import annotations

import sys
from typing import Any

import attrs
import numpy as np


def is_python_number(leaf: Any) -> bool:
    """A Python ``float``/``int``/``bool`` (not a numpy scalar, which is an array)."""
    return isinstance(leaf, (float, int)) and not isinstance(leaf, np.generic)


@attrs.frozen(eq=False)
class NNXModule:
    """Flax NNX: a module split into its graph (static), its ``nnx.Param`` state
    (differentiated where Active) and the rest of its state (data, never differentiated)."""

    library = "flax.nnx"

    def split(self, module: Any) -> tuple[Any, Any, Any]:
        nnx = sys.modules["flax.nnx"]
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        return graphdef, params, rest

    def merge(self, graphdef: Any, params: Any, rest: Any) -> Any:
        return sys.modules["flax.nnx"].merge(graphdef, params, rest)

    def result(self, graphdef: Any, params: Any) -> Any:
        return params  # an nnx.State of the parameters: what nnx.grad returns

    def describe(self, module: Any) -> str:
        return f"a Flax NNX {type(module).__name__}"


_NNX = NNXModule()


def adapter_for(value: Any) -> NNXModule | None:
    """The convention that splits ``value`` itself (not a plain pytree), or None."""
    nnx = sys.modules.get("flax.nnx")  # a module of a library not imported cannot be this one
    if nnx is not None and isinstance(value, nnx.Module):
        return _NNX
    return None


__all__ = ["is_python_number", "adapter_for", "NNXModule"]

"""The types the operators' overloads share: what a result's type follows from.

A result is typed where its type follows from the arguments: one Active
argument gives a result of its type (a ``torch.nn.Module`` gives a dict of
tensors, a Flax NNX module an ``nnx.State``), ``f``'s return type gives the value's and the output tangents' type.
A bare Python number as the Active value comes back as the framework's
scalar (a JAX array on AutoJAX), so it is typed ``Any``, as is everything with
several Active arguments or a layout built from both (Jacobians, Hessians).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Protocol, TypeAlias, TypeVar, Union

from .._annotations import Cache, Constant

if TYPE_CHECKING:
    import torch
    from flax import nnx

T = TypeVar("T")  # the one Active argument's value
R = TypeVar("R")  # what f returns
A = TypeVar("A")  # the aux f returns with has_aux=True


class TorchModuleLike(Protocol):
    """A ``torch.nn.Module`` as the overloads see it: by its methods, so that checking a call
    needs no torch installed and a JAX value never matches it."""

    def named_parameters(self) -> Iterator[tuple[str, Any]]: ...


class NNXModuleLike(Protocol):
    """A Flax NNX module as the overloads see it (by its methods, like `TorchModuleLike`)."""

    def iter_modules(self) -> Iterator[tuple[Any, Any]]: ...

    def sow(self, *args: Any, **kwargs: Any) -> Any: ...


Data: TypeAlias = Union[Constant[Any], Cache[Any]]
"""An argument that is not Active: with one Active argument, all others are these."""

ModuleGradient: TypeAlias = "dict[str, torch.Tensor]"
"""A module's derivative: one tensor per trainable parameter, keyed like ``named_parameters()``."""

NNXGradient: TypeAlias = "nnx.State[Any, Any]"
"""An NNX module's derivative: the state of its ``nnx.Param`` variables, as ``nnx.grad`` gives it."""

"""The types the operators' overloads share: what a result's type follows from.

A result is typed where its type follows from the arguments: one Active
argument gives a result of its type (a ``torch.nn.Module`` gives a dict of
tensors, a Flax NNX module an ``nnx.State``), ``f``'s return type gives the value's and the output tangents' type.
Several positional Active arguments (up to three, before the Constants) give a
tuple of their types. A bare Python number as the Active value comes back as the framework's
scalar (a JAX array on AutoJAX), so it is typed ``Any``; with several Actives,
a number or a module among them makes the whole result ``Any`` (typing has no
way to map each position's type on its own without an overload per combination).
A Jacobian or Hessian is a layout built from both structures: it is typed
where both are one array, an Active array or number and an ``f`` returning one
array, as that array's type (``jax.Array``, ``torch.Tensor``, ``numpy.ndarray``:
the framework's arrays are the result's); else ``Any``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Protocol, TypeAlias, TypeVar, Union

from .._annotations import Cache, Constant

if TYPE_CHECKING:
    import torch
    from flax import nnx

T = TypeVar("T")  # the one Active argument's value
T1 = TypeVar("T1")  # the values of several Active arguments, in order
T2 = TypeVar("T2")
T3 = TypeVar("T3")
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


class ArrayLike(Protocol):
    """One array of any framework (``jax.Array``, ``torch.Tensor``, ``numpy.ndarray``), by the
    attributes they share; a pytree, a module or a Python number has neither."""

    @property
    def shape(self) -> Any: ...

    @property
    def dtype(self) -> Any: ...


AR = TypeVar("AR", bound=ArrayLike)  # f's output, where it is one array (Jacobians, Hessians)
AT = TypeVar("AT", bound=ArrayLike)  # the one Active argument's value, where it is one array

Special: TypeAlias = Union[TorchModuleLike, NNXModuleLike, float]
"""An Active value whose derivative is not of its own type (a module's is a dict or a state, a
number's the framework's scalar): with several Actives, one of these types the result ``Any``.
mypy also matches a torch module to `ArrayLike` (through ``Module.__getattr__``): overloads on
`ArrayLike` come after the ones that take these."""

Data: TypeAlias = Union[Constant[Any], Cache[Any]]
"""An argument that is not Active: with one Active argument, all others are these."""

ModuleGradient: TypeAlias = "dict[str, torch.Tensor]"
"""A module's derivative: one tensor per trainable parameter, keyed like ``named_parameters()``."""

NNXGradient: TypeAlias = "nnx.State[Any, Any]"
"""An NNX module's derivative: the state of its ``nnx.Param`` variables, as ``nnx.grad`` gives it."""

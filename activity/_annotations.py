"""The three argument annotations: what each argument of ``f`` *is*."""

from __future__ import annotations

from typing import Any, ClassVar, Generic, TypeVar

import attrs

# Covariant: an annotation only holds its value, so an Active[Linear] is an Active[Module].
T = TypeVar("T", covariant=True)


def _refuse_nesting(instance: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, Annotation):
        raise TypeError(
            f"{type(instance).__name__}({type(value).__name__}(...)) nests two annotations; "
            f"an argument has exactly one kind. Write {type(value).__name__}(x) or "
            f"{type(instance).__name__}(x), not both."
        )


@attrs.frozen(repr=False)
class Annotation(Generic[T]):
    """Base of `Active`, `Constant` and `Cache`: an immutable wrapper of one argument."""

    value: T = attrs.field(validator=_refuse_nesting)
    kind: ClassVar[str] = "annotation"
    __activity_leaf__: ClassVar[bool] = True  # never a pytree node: a nested annotation is an error

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.value!r})"


@attrs.frozen(repr=False)
class Active(Annotation[T]):
    """An argument to differentiate with respect to.

    The value is a float scalar, an array, a pytree of them, or a
    ``torch.nn.Module`` (its trainable parameters are differentiated).
    Non-floating leaves pass through and get ``None`` in the result.

    Args:
        value: the argument's value: a float scalar, an array, a pytree of them, or a module.

    Raises:
        TypeError: ``value`` is itself an annotation (``Active(Constant(x))``).

    >>> import numpy as np
    >>> import activity as ad
    >>> ad.gradient(lambda x: (x**2).sum(), ad.Active(np.array([1.0, 2.0])),
    ...             backend=ad.AutoFiniteDifferences())
    array([2., 4.])
    """

    kind: ClassVar[str] = "active"


@attrs.frozen(repr=False)
class Constant(Annotation[T]):
    """An argument that is data: passed as-is, never differentiated, never mutated.

    Under JIT, array leaves are traced (new data of the same shape never
    recompiles) and other leaves are static.

    Args:
        value: the argument's value, of any type (arrays, pytrees, modules, Python objects).

    Raises:
        TypeError: ``value`` is itself an annotation.

    >>> import numpy as np
    >>> import activity as ad
    >>> ad.gradient(lambda w, x: (w * x).sum(), ad.Active(np.ones(2)),
    ...             ad.Constant(np.array([3.0, 4.0])), backend=ad.AutoFiniteDifferences())
    array([3., 4.])
    """

    kind: ClassVar[str] = "constant"


@attrs.frozen(repr=False)
class Cache(Annotation[T]):
    """Scratch storage ``f`` may overwrite; its initial content does not matter.

    ``f`` receives a buffer of the same structure and shape that can hold the
    values being differentiated; derivatives flow through what ``f`` writes
    into it and reads back.

    Args:
        value: an array or a pytree of arrays giving the buffers' structure, shapes and dtypes.

    Raises:
        TypeError: ``value`` is itself an annotation.

    >>> import numpy as np
    >>> import activity as ad
    >>> def f(x, buf):
    ...     buf[:] = 3 * x
    ...     return buf.sum()
    >>> ad.gradient(f, ad.Active(np.ones(2)), ad.Cache(np.zeros(2)),
    ...             backend=ad.AutoFiniteDifferences())
    array([3., 3.])
    """

    kind: ClassVar[str] = "cache"

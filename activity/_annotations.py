"""The three argument annotations: what each argument of ``f`` *is*."""

from __future__ import annotations

from typing import Any, ClassVar, Generic, TypeVar

import attrs
import numpy as np

from ._errors import short_repr

# Covariant: an annotation only holds its value, so an Active[Linear] is an Active[Module].
T = TypeVar("T", covariant=True)


def _refuse_nesting(instance: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, Annotation):
        raise TypeError(
            f"{type(instance).__name__}({type(value).__name__}(...)) nests two annotations; "
            f"an argument has exactly one kind. Write {type(value).__name__}(x) or "
            f"{type(instance).__name__}(x), not both."
        )


def is_predicate(where: Any) -> bool:
    """Whether a ``where`` is a callable ``(path, leaf) -> bool``, not a pytree of bools (an
    Equinox module is callable and a pytree: as a mask it is a filter spec)."""
    from ._tree import flatten

    return callable(where) and flatten(where)[1].is_leaf()


def _check_where(instance: Any, attribute: Any, where: Any) -> None:
    if where is None:
        return
    if is_predicate(where):
        _check_two_arguments(where)
        return
    from ._tree import flatten, leaf_paths

    leaves, _ = flatten(where)
    for index, leaf in enumerate(leaves):
        if not isinstance(leaf, (bool, np.bool_)):
            raise TypeError(
                f"Active(..., where=...) takes a callable (path, leaf) -> bool or a pytree of bools, but "
                f"where holds {type(leaf).__name__} {short_repr(leaf, 40)} at {leaf_paths(where)[index] or 'its root'}. "
                f"Use True to differentiate a part and False to keep it constant."
            )
    if not leaves:
        raise TypeError(
            "Active(..., where=...) got a mask with no bool in it, so it selects nothing. Mark the "
            "argument Constant(...) if nothing in it is differentiated."
        )


def _check_two_arguments(where: Any) -> None:
    """A one-argument filter (``eqx.is_inexact_array``, ``lambda leaf: ...``) is refused here,
    naming the fix, rather than by a bare TypeError from deep inside the first call."""
    import inspect

    try:
        inspect.signature(where).bind("['path']", None)
    except TypeError:
        name = getattr(where, "__name__", type(where).__name__)
        fix = "where=lambda path, leaf: <your test of leaf>" if name == "<lambda>" else f"where=lambda path, leaf: {name}(leaf)"
        raise TypeError(
            f"Active(..., where={name}): a callable where= is called as where(path, leaf) (path a string "
            f"such as \"['w']\"), and this one does not take those two arguments. For a test of the leaf "
            f"alone, take the path too: {fix}."
        ) from None
    except ValueError:  # no signature to read (some builtins): its first call says what is wrong
        return


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

    ``where`` differentiates only part of the value: a callable
    ``(path, leaf) -> bool`` (``path`` as printed in messages, e.g. ``"['w']"``,
    or ``"0.weight"`` for a torch module's parameter, named like
    ``named_parameters()``), or a pytree of bools with a prefix of the value's
    structure. The other leaves are Constant leaves: used, never
    differentiated, ``None`` in the result (absent from a module's dict).

    Args:
        value: the argument's value: a float scalar, an array, a pytree of them, or a module.
        where: the part of ``value`` to differentiate (None: all of it), as above.

    Raises:
        TypeError: ``value`` is itself an annotation (``Active(Constant(x))``).

    >>> import numpy as np
    >>> import activity as ad
    >>> ad.gradient(lambda x: (x**2).sum(), ad.Active(np.array([1.0, 2.0])),
    ...             backend=ad.AutoFiniteDifferences())
    array([2., 4.])
    >>> params = {"w": np.array([1.0, 2.0]), "b": np.array(3.0)}
    >>> ad.gradient(lambda p: (p["w"] * p["b"]).sum(), ad.Active(params, where={"w": True, "b": False}),
    ...             backend=ad.AutoFiniteDifferences())
    {'w': array([3., 3.]), 'b': None}
    """

    where: Any = attrs.field(default=None, kw_only=True, validator=_check_where)
    kind: ClassVar[str] = "active"

    def __repr__(self) -> str:
        if self.where is None:
            return f"Active({self.value!r})"
        return f"Active({self.value!r}, where={self.where!r})"


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

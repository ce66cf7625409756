"""Padded embedding lookups in forward mode, on torch's reverse-mode convention.

``nn.Embedding(padding_idx=...)`` is a convention of torch's *backward* only: the padding
row gets no gradient, it stays a fixed pad. Torch's forward-mode rule for ``embedding``
is the plain lookup of the tangent table, padding row included, so a pushforward through
a padded lookup counted the padding row's tangent (not ``<gradient, tangent>``), and the
two Hessian-vector paths of `AutoTorch` disagreed: forward over reverse took the padding
row's tangent into the other parameters' second derivatives, the double backward did not
(``hessian``, batched forward over reverse, was not the matrix of ``hvp``). Every Hugging
Face model with a padding token in its input met it.

While a forward-mode pass of `AutoTorch` runs ``f`` on modules that hold such a lookup,
`on_reverse_convention` rewrites each padded ``embedding`` call so that the outputs at
padding positions carry no tangent: derivatives of the function whose padding row is a
constant, which is what the gradient is of. Values and reverse-mode gradients do not
change (the lookup runs as called; the padding positions already send nothing back).

``scale_grad_by_freq=True`` is left as torch has it: its gradient (each row's divided by
how often the batch looks it up) is a derivative of no function, so no tangent agrees
with it; torch's pushforward is f's derivative and both Hessian-vector paths give the
Jacobian of that gradient.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

_MODE: Any = None  # the TorchFunctionMode subclass, made on first use (torch imported lazily)

# `torch.nn.functional.embedding`'s and `torch.embedding`'s parameters, in order.
_FUNCTIONAL = ("input", "weight", "padding_idx")
_ATEN = ("weight", "indices", "padding_idx")


def holds_lookups(module: Any) -> bool:
    """Whether a module looks rows up with a padding index: it keeps a ``padding_idx`` other
    than None in its own ``__dict__`` (``nn.Embedding(padding_idx=...)`` does, as do the
    embedding modules of model libraries that call ``F.embedding`` themselves). Every
    ``nn.Embedding`` has the attribute, most hold None: their forward passes, which the
    rewrite's torch-function mode would slow down op by op, run as they are. The value is
    read when the module is described; one set later takes effect from the next description."""
    return module.__dict__.get("padding_idx") is not None


def _problem_of(F: Any) -> Any:
    """The `Problem` a flat function was made for, through the derivatives made of it."""
    while F is not None:
        problem = getattr(F, "problem", None)
        if problem is not None:
            return problem
        F = getattr(F, "source", None)
    return None


def on_reverse_convention(F: Any, G: Callable[..., Any]) -> Callable[..., Any]:
    """``G`` (``F``, or a function made of it, for a forward-mode evaluation), running with
    the lookup rewrite where ``F``'s modules hold a lookup (`holds_lookups`); else ``G``
    itself, at no cost on other models."""
    problem = _problem_of(F)
    if problem is None or not any(getattr(d, "has_lookups", False) for d in problem._described.values()):
        return G
    mode = _mode()

    def rewritten(*args: Any) -> Any:
        with mode():
            return G(*args)

    return rewritten


def _mode() -> Any:
    global _MODE
    if _MODE is None:
        torch = sys.modules["torch"]
        functional, aten = torch.nn.functional.embedding, torch.embedding
        base: Any = torch.overrides.TorchFunctionMode

        class ReverseConventionLookups(base):  # type: ignore[misc]
            def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
                kwargs = kwargs or {}
                if func is functional:
                    return _lookup(func, _FUNCTIONAL, args, kwargs, functional=True)
                if func is aten:
                    return _lookup(func, _ATEN, args, kwargs, functional=False)
                return func(*args, **kwargs)

        _MODE = ReverseConventionLookups
    return _MODE


def _lookup(func: Callable[..., Any], names: tuple[str, ...], args: Any, kwargs: dict[str, Any], functional: bool) -> Any:
    bound = dict(zip(names, args))
    bound.update((name, kwargs[name]) for name in names if name in kwargs)
    pad = bound.get("padding_idx", None if functional else -1)
    out = func(*args, **kwargs)
    if pad is None or (pad < 0 and not functional):  # torch.embedding's -1: no padding
        return out
    indices, weight = bound["input" if functional else "indices"], bound["weight"]
    if pad < 0:  # F.embedding counts a negative index from the end
        pad += weight.shape[0]
    return sys.modules["torch"].where((indices == pad).unsqueeze(-1), out.detach(), out)

"""f's runs kept apart from torch's parametrization cache (`torch.nn.utils.parametrize.cached`).

Inside ``with parametrize.cached():`` torch keeps each parametrized tensor it computes in one
global dict, keyed by the id of the module the parametrization was registered on: the same key
for the user's module, its deep copies and the views f runs on. A view would then read a value
the user's own forward cached (computed from the user's parameters, not from the tape's leaves:
a zero derivative), and leave one computed from its tape leaves for the user's next forward and
the next call to read. So while f runs it gets a cache of its own, empty, as a fresh
``cached()`` block would be, and the user's cache is put back afterwards untouched.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, TypeVar

_Result = TypeVar("_Result")

# The cache is one global of torch's: one swap at a time (re-entrant: f may call activity again).
_SWAP = threading.RLock()


def parametrize_module() -> Any:
    """``torch.nn.utils.parametrize``, whose ``_cache_enabled`` says whether a cached block is open."""
    import torch.nn.utils.parametrize as parametrize

    return parametrize


def apart_from_the_cache(parametrize: Any, call: Callable[..., _Result]) -> Callable[..., _Result]:
    """``call``, run with an empty parametrization cache of its own, the user's restored after.

    >>> import torch
    >>> parametrize = parametrize_module()
    >>> with parametrize.cached():
    ...     users = parametrize._cache
    ...     result = apart_from_the_cache(parametrize, lambda: parametrize._cache is users)()
    ...     parametrize._cache is users
    True
    >>> result
    False
    """

    def run(*args: Any) -> _Result:
        with _SWAP:
            users = parametrize._cache
            parametrize._cache = {}
            try:
                return call(*args)
            finally:
                parametrize._cache = users

    return run

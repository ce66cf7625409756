"""f's runs kept apart from pyro's global parameter store (`pyro.get_param_store()`).

A ``pyro.nn.PyroModule`` keeps its parameters in step with one global store, by name: on
each access inside a call, a ``PyroParam`` whose name the store holds with another tensor
is replaced in the module by the store's tensor, and one the store lacks is put in the store
(an ``nn.Parameter`` of a ``PyroModule`` is registered there too). A view f runs on holds
tape leaves (or the finite differences' copies) where the user's module holds its
parameters, so the store would swap the user's own parameter back into the view (a zero
derivative) and keep the view's tensors for the user's next call, which would then put them
into the user's module. So while f runs the store holds the view's tensor wherever it held a
parameter of the user's that the view replaced, and the store is put back as it was after.
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any, Callable, TypeVar

_Result = TypeVar("_Result")

# The store is one global of pyro's: one swap at a time (re-entrant: f may call activity again).
_SWAP = threading.RLock()

_PARTS = ("_params", "_param_to_name", "_constraints")  # what ParamStoreDict holds


_HOLDS_PYRO: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()  # description -> its answer


def holds_pyro_modules(descriptions: Any) -> bool:
    """Whether a described module is, or holds, a ``PyroModule`` (what reads and writes the store);
    only those calls take the store's lock, which a plain module's f (one that waits for another
    thread's activity call) must never wait on."""
    pyro_module = sys.modules["pyro.nn.module"].PyroModule
    for description in descriptions:
        known = _HOLDS_PYRO.get(description)
        if known is None:
            module = description.module
            known = module is not None and any(isinstance(m, pyro_module) for m in module.modules())
            _HOLDS_PYRO[description] = known
        if known:
            return True
    return False


def apart_from_the_param_store(store: Any, replaced: dict[int, Any], call: Callable[..., _Result]) -> Callable[..., _Result]:
    """``call``, run while ``store`` holds the view's tensors in place of the user's parameters
    (``replaced``, see `_torch_modules.replaced_parameters`); afterwards the store is exactly as it was, the
    entries f added (the view's tensors under new names) gone."""

    def run(*args: Any) -> _Result:
        with _SWAP:
            users = [(name, getattr(store, name)) for name in _PARTS]
            saved = [(name, held, dict(held)) for name, held in users]
            params, to_name = store._params, store._param_to_name
            for name, tensor in list(params.items()):
                viewed = replaced.get(id(tensor))
                if viewed is not None:
                    params[name] = viewed
                    to_name[viewed] = name
            try:
                return call(*args)
            finally:
                for name, held, content in saved:  # in place: f or pyro may have replaced the dicts
                    held.clear()
                    held.update(content)
                    setattr(store, name, held)

    return run

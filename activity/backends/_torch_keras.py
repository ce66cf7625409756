"""Keras 3 models on its torch backend, run by f on activity's views.

With ``KERAS_BACKEND="torch"`` a Keras layer is a ``torch.nn.Module`` whose parameters
(``torch_params``) are the tensors its Keras variables hold, but its ``call`` reads each
weight through the variable (``variable.value``), never through the module's parameter
slots. A view f runs on holds tape leaves (or the finite differences' copies) in those
slots, which the layer would never read: its forward would use the user's weights, and the
derivative through them would be lost. So while f runs, a Keras ``StatelessScope`` maps
each variable of the argument's layers to the view's tensor in its place, as Keras's own
``stateless_call`` maps them to the values it is given; what the forward assigns (a
``BatchNormalization``'s moving statistics in training, a seed generator's state) stays in
that scope, and the user's variables never change.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, TypeVar

from .._errors import UnsupportedError

_Result = TypeVar("_Result")

# Instance attributes Keras sets on every layer (``Layer.__new__``): wrappers of the class's
# ``build`` and ``quantize`` that close over the layer. A view never calls them (an unbuilt
# layer is refused), so they do not stop a view from being made.
KERAS_WRAPPERS = frozenset(("build", "quantize"))


def keras_layer_type() -> Any:
    """Keras's ``Layer`` class where Keras is loaded, else None (no layer can then exist)."""
    layer = sys.modules.get("keras.src.layers.layer")
    return None if layer is None else layer.Layer


def check_built(module: Any, where: str) -> None:
    """Refuse a Keras layer that is not built: its first call would create its variables on the
    user's layer, in the middle of activity's call."""
    if not getattr(module, "built", True):
        raise UnsupportedError(
            f"activity: {where} is a Keras layer that is not built yet (its weights are made by its "
            f"first call). Call it once on an input of the right shape, or call its build(input_shape), "
            f"before differentiating it."
        )


_HOLDS_KERAS: weakref.WeakKeyDictionary[Any, tuple[Any, ...]] = weakref.WeakKeyDictionary()  # description -> its variables


def keras_variables(descriptions: Any) -> list[tuple[Any, Any]]:
    """``(module, its Keras variables)`` for each described module that is, or holds, a Keras layer."""
    layer = keras_layer_type()
    found = []
    for description in descriptions:
        held = _HOLDS_KERAS.get(description)
        if held is None:
            module, seen, collected = description.module, set(), []
            for m in () if module is None else module.modules():
                if isinstance(m, layer):
                    for variable in m.variables:
                        if id(variable) not in seen:
                            seen.add(id(variable))
                            collected.append(variable)
            held = _HOLDS_KERAS[description] = tuple(collected)
        if held:
            found.append((description.module, held))
    return found


def in_stateless_scope(variables: list[tuple[Any, Any]], replaced: dict[int, Any], call: Callable[..., _Result]) -> Callable[..., _Result]:
    """``call``, run inside a Keras ``StatelessScope`` in which every variable whose tensor the
    view replaced (``replaced``: ``id(user's tensor) -> the view's``) reads the view's tensor."""
    StatelessScope = sys.modules["keras"].StatelessScope  # loaded: a Keras layer was found

    mapping = []
    for _, held in variables:
        for variable in held:
            viewed = replaced.get(id(variable._value))  # the tensor the variable holds (a torch Parameter)
            if viewed is not None:
                mapping.append((variable, viewed))

    def run(*args: Any) -> _Result:
        with StatelessScope(state_mapping=mapping):
            return call(*args)

    return run

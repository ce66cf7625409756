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
  The same holds for NNX modules inside a pytree (``{"model": module, "scale": s}``,
  a list of modules), as ``nnx.grad`` treats such an argument: each module is
  differentiated in its ``nnx.Param`` variables and comes back as an ``nnx.State``
  in its place, the other leaves follow the pytree rule, and a variable shared by
  two of the modules is one parameter, listed under its first one. "Module" here is
  any NNX graph object (``nnx.Pytree``: a user's subclass, ``nnx.Rngs``, ``nnx.Optimizer``),
  which ``nnx.grad`` splits the same way.
- A Penzai model (or any pytree holding Penzai variables): its ``pz.Parameter``
  variables, as Penzai's own recipe (``pz.unbind_params(model, freeze=True)``,
  ``jax.grad`` of the frozen values, ``pz.bind_variables`` inside) and its
  trainer differentiate. The result is the tuple of ``pz.ParameterValue`` of
  gradients, one per Parameter in ``pz.unbind_params`` order (what the optax
  state built from ``pz.freeze_params`` takes); a Parameter used at two places
  is one entry. ``pz.StateVariable`` values, and arrays outside variables, are data
  (an Active container of models and loose arrays is refused). ``f`` gets a model bound
  to fresh variables on every call, so what ``f`` writes into a variable never
  reaches the user's (Penzai variables are mutable Python objects, not pytrees).
- A torch module: its parameters with ``requires_grad=True``; the torch backend's
  module descriptions (`backends._torch_modules`) implement it.
- A Keras 3 model or layer on the JAX backend: its trainable variables, as Keras's own
  ``stateless_call`` takes them. The result is a dict of their gradients keyed by each
  variable's ``path`` (``"sequential/dense/kernel"``); ``f`` gets the user's model, whose
  variables read the call's values inside a Keras ``StatelessScope``, so what ``f``
  assigns (BatchNormalization statistics, seed generator states) never reaches the user's.
  The same holds for Keras models and variables inside a pytree (``{"model": model, "scale": s}``,
  a list of two models, ``model.trainable_variables``): each model comes back as its dict of
  gradients in its place, each variable as its gradient, the other leaves follow the pytree
  rule, and a variable two of them hold is one parameter, listed under the first. (On the torch backend a Keras layer is a torch module: see
  `backends._torch_keras`.)
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from ._arrays import dtype_kind
from ._errors import short_repr
from ._tree import flatten, leaf_paths, unflatten


def is_python_number(leaf: Any) -> bool:
    """A Python ``float``/``int``/``bool`` (not a numpy scalar, which is an array)."""
    return isinstance(leaf, (float, int)) and not isinstance(leaf, np.generic)


def _floats_as_arrays(params: Any) -> Any:
    """An NNX module's ``nnx.Param`` state with each Python float value as a JAX array. A Param
    holding a float (``nnx.Param(2.0)``) is a parameter: ``nnx.grad`` differentiates it, as
    ``jax.grad`` does a float argument. Left a float, it would be taken for a static
    hyper-parameter, which is what a Python number is elsewhere in a pytree."""
    jax = sys.modules["jax"]
    if not any(isinstance(leaf, float) and is_python_number(leaf) for leaf in jax.tree_util.tree_leaves(params)):
        return params
    as_array = jax.numpy.asarray
    return jax.tree_util.tree_map(lambda leaf: as_array(leaf) if isinstance(leaf, float) and is_python_number(leaf) else leaf, params)


@attrs.frozen(eq=False)
class NNXModule:
    """Flax NNX: a module split into its graph (static), its ``nnx.Param`` state
    (differentiated where Active) and the rest of its state (data, never differentiated)."""

    library = "flax.nnx"

    def split(self, module: Any) -> tuple[Any, Any, Any]:
        nnx = sys.modules["flax.nnx"]
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        return graphdef, _floats_as_arrays(params), rest

    def merge(self, graphdef: Any, params: Any, rest: Any) -> Any:
        return sys.modules["flax.nnx"].merge(graphdef, params, rest)

    def result(self, graphdef: Any, params: Any) -> Any:
        return params  # an nnx.State of the parameters: what nnx.grad returns

    def mask(self, graphdef: Any, where: Any) -> Any:
        """A ``where=`` pytree of bools in the structure of the parameters' ``nnx.State``: a
        plain nested dict (``{"head": True, "body": False}``) is read as that state."""
        return _as_state(where)

    def mask_paths(self, params: Any) -> list[str]:
        """The paths a ``where`` callable is given: the parameter state's, without the variables' ``.value``."""
        return [path[: -len(".value")] if path.endswith(".value") else path for path in leaf_paths(params)]

    def describe(self, module: Any) -> str:
        return f"a Flax NNX {type(module).__name__}"

    def data_note(self, rest: Any) -> str | None:
        return _nnx_data_note(rest)

    def difference(self, graphdef: Any, module: Any) -> str | None:
        """The first static attribute where ``module`` differs from the module ``graphdef`` was
        split from (``Dropout.deterministic`` after ``model.eval()``), or None where that is not
        told so simply (a submodule or a variable added or removed)."""
        nnx = sys.modules["flax.nnx"]
        try:
            prepared = dict(nnx.iter_graph(nnx.merge(graphdef, *self.split(module)[1:])))
            for path, now in nnx.iter_graph(module):
                name = str(path[-1]) if path else ""
                if name.startswith("_pytree") or isinstance(now, (nnx.Pytree, nnx.Variable)) or hasattr(now, "dtype"):
                    continue
                then = prepared.get(path, _MISSING)
                if then is _MISSING or type(then) is not type(now) or bool(then != now):
                    where = ".".join(str(part) for part in path)
                    return f"its attribute {where} is {short_repr(now)}, prepared with {short_repr(then)}"
        except Exception:  # noqa: BLE001 - a graph merge cannot rebuild, or == that is no bool: no detail
            return None
        return None


def _nnx_data_note(rest: Any) -> str | None:
    """Say, where an Active NNX module has nothing (or nothing selected) to differentiate, which
    of its floating variables are data by NNX's convention and how to differentiate them: a
    variable type of the user's own (``class Lora(nnx.Variable)``), or a plain ``nnx.Variable``,
    is what ``nnx.grad(..., argnums=nnx.DiffState(0, Lora))`` reaches and ``Active`` does not,
    while ``where=`` is offered the ``nnx.Param`` paths only. Flax's own state types (batch
    statistics, RNG state, caches) are left out: those are data by intent."""
    jax, nnx = sys.modules["jax"], sys.modules["flax.nnx"]
    found = []
    for path, variable in jax.tree_util.tree_leaves_with_path(rest, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        if not isinstance(variable, nnx.Variable) or isinstance(variable, nnx.Param):
            continue
        if type(variable) is not nnx.Variable and type(variable).__module__.startswith("flax."):
            continue
        if any(dtype_kind(leaf) == "f" for leaf in jax.tree_util.tree_leaves(variable.get_value())):
            found.append((jax.tree_util.keystr(path), type(variable).__name__))
    if not found:
        return None
    named = ", ".join(f"a {kind} at {path}" for path, kind in found[:3]) + (", ..." if len(found) > 3 else "")
    kind = found[0][1]
    return (
        f"A Flax NNX module is differentiated in its nnx.Param variables, as nnx.grad is by default, and "
        f"where= chooses among those; its other variables are data: {named}. To differentiate a {kind}, "
        f"make its class a subclass of nnx.Param, or split the module before the call (graphdef, chosen, "
        f"rest = nnx.split(model, {kind}, ...)), pass Active(chosen), Constant(rest), Constant(graphdef) "
        f"and rebuild it in f with nnx.merge(graphdef, chosen, rest)."
    )


_MISSING = object()


def _as_state(where: Any) -> Any:
    nnx = sys.modules["flax.nnx"]
    if isinstance(where, Mapping) and not isinstance(where, nnx.State):
        return nnx.State(where)  # nested dicts become nested states
    return where


def _nnx_object_type(nnx: Any) -> Any:
    """The base class of NNX's graph objects: ``nnx.Pytree`` (flax 0.11 on), ``nnx.Object`` before.
    ``nnx.Module`` is one of them, and so are ``nnx.Optimizer``, ``nnx.Rngs`` and a user's own
    ``class Pair(nnx.Pytree)`` holding ``nnx.Param`` variables or modules: ``nnx.grad`` splits every
    one of them by its variables' types (``nnx.Param`` by default), so activity does too. Read as a
    plain pytree, such an object had its batch statistics and optimiser moments differentiated
    and came back as itself holding gradients, where ``nnx.grad`` gives the Params' ``nnx.State``."""
    return getattr(nnx, "Pytree", None) or nnx.Object


def _is_nnx_module(node: Any) -> bool:
    nnx = sys.modules["flax.nnx"]
    return isinstance(node, _nnx_object_type(nnx))


@attrs.frozen(eq=False)
class NNXModulesInPytree:
    """Flax NNX modules inside a pytree: the modules are split together (so that a variable
    two of them share is one parameter), each replaced by its ``nnx.Param`` state; the
    other leaves of the pytree stay where they are. The static part is the pytree's
    structure down to the modules, where the modules are in it, and their joint graph."""

    library = "flax.nnx"

    def split(self, value: Any) -> tuple[Any, Any, Any]:
        nnx = sys.modules["flax.nnx"]
        leaves, spec = flatten(value, is_leaf=_is_nnx_module)
        where = tuple(index for index, leaf in enumerate(leaves) if _is_nnx_module(leaf))
        graphdef, params, rest = nnx.split([leaves[index] for index in where], nnx.Param, ...)
        params = _floats_as_arrays(params)
        # a module whose variables all belong to an earlier one has no entry in the joint state
        for number, index in enumerate(where):
            leaves[index] = params[number] if number in params else nnx.State({})
        rests = [rest[number] if number in rest else nnx.State({}) for number in range(len(where))]
        return (spec, where, graphdef), unflatten(spec, leaves), rests

    def merge(self, static: Any, params: Any, rest: Any) -> Any:
        nnx = sys.modules["flax.nnx"]
        spec, where, graphdef = static
        leaves = spec.flatten_up_to(params)
        joint = nnx.State({number: leaves[index] for number, index in enumerate(where)})
        modules = nnx.merge(graphdef, joint, nnx.State(dict(enumerate(rest))))
        for module, index in zip(modules, where):
            leaves[index] = module
        return unflatten(spec, leaves)

    def result(self, static: Any, params: Any) -> Any:
        return params  # the pytree with each module's nnx.State of gradients in its place

    def mask(self, static: Any, where: Any) -> Any:
        """A ``where=`` pytree whose part for each module may be a plain nested dict, read as
        that module's ``nnx.State``; a mask that stops above the modules is left as given."""
        spec, modules, _ = static
        try:
            parts = spec.flatten_up_to(where)
        except (ValueError, TypeError):
            return where
        for index in modules:
            parts[index] = _as_state(parts[index])
        return unflatten(spec, parts)

    def mask_paths(self, params: Any) -> list[str]:
        """As for one NNX module: the parameter states' paths, without the variables' ``.value``."""
        return _NNX.mask_paths(params)

    def describe(self, value: Any) -> str:
        return f"a {type(value).__name__} holding Flax NNX modules"

    def data_note(self, rest: Any) -> str | None:
        return _nnx_data_note(rest)


@attrs.frozen
class Bound:
    """What an adapter's ``merge`` gives where ``f`` must get the user's own object, bound to
    the call's values only while ``f`` runs (`Problem.call` unwraps it): ``value`` is the
    object for ``f``, ``scope()`` the context manager in which it reads the call's values."""

    value: Any
    scope: Any


def _check_built(model: Any) -> None:
    if not model.built:
        raise TypeError(
            f"activity: a Keras {type(model).__name__} that is not built yet (its weights are made by its "
            f"first call) cannot be split into its weights. Call it once on an input of the right shape, or "
            f"call its build(input_shape), before passing it."
        )


def _is_keras_layer(node: Any) -> bool:
    layer = sys.modules.get("keras.src.layers.layer")
    return layer is not None and isinstance(node, layer.Layer)


def _is_keras_object(node: Any) -> bool:
    """A Keras layer (a model) or variable."""
    variables = sys.modules.get("keras.src.backend.common.variables")
    return _is_keras_layer(node) or (variables is not None and isinstance(node, variables.Variable))


@attrs.frozen(eq=False)
class KerasModelsInPytree:
    """Keras 3 layers, models and variables inside a pytree (``{"model": model, "scale": s}``,
    a generator and a discriminator in a list, ``model.trainable_variables``), on the JAX
    backend: each model is replaced by the dict of its trainable variables' values keyed by
    path, as `KerasModel` splits one, each variable by its value (differentiated, where Active,
    by the pytree rule), and the other leaves of the pytree stay where they are. Left a leaf,
    a model or a variable would be a static value, its weights neither differentiated nor seen
    to change by a prepared call. A variable two of them hold is one parameter, listed under
    the first (a later variable leaf that is the same object is an empty dict). The static
    part is the pytree's structure down to the models and variables, where they are in it,
    the objects themselves and the models' variables' paths; inside f they read the call's
    values through one ``StatelessScope``."""

    library = "keras"
    binds = True

    def split(self, value: Any) -> tuple[Any, Any, Any]:
        leaves, spec = flatten(value, is_leaf=_is_keras_object)
        where = tuple(index for index, leaf in enumerate(leaves) if _is_keras_object(leaf))
        held = [leaves[index] for index in where]
        for node in held:
            if _is_keras_layer(node):
                _check_built(node)
        layouts, rests = [], []
        for index, node, (trainable, other) in zip(where, held, _variables_of(held)):
            layouts.append((node, tuple(trainable), tuple(other)))
            if _is_keras_layer(node):
                leaves[index] = {path: v.value for path, v in trainable.items()}
            else:  # a variable: its value, or nothing where an earlier node holds it
                leaves[index] = trainable[node.path].value if trainable else {}
            rests.append({path: v.value for path, v in other.items()})
        return (spec, where, tuple(layouts)), unflatten(spec, leaves), tuple(rests)

    def merge(self, static: Any, params: Any, rest: Any) -> Bound:
        spec, where, layouts = static
        leaves = spec.flatten_up_to(params)
        held = [node for node, _, _ in layouts]
        mapping = []
        for index, node, values, (trainable, other) in zip(where, held, rest, _variables_of(held)):
            if _is_keras_layer(node):
                mapping += [(trainable[path], value) for path, value in leaves[index].items()]
            elif trainable:
                mapping.append((node, leaves[index]))
            mapping += [(other[path], value) for path, value in values.items()]
            leaves[index] = node
        keras = sys.modules["keras"]
        return Bound(unflatten(spec, leaves), lambda: keras.StatelessScope(state_mapping=mapping))

    def result(self, static: Any, params: Any) -> Any:
        return params  # the pytree with each model's {variable path: gradient}, each variable's gradient, in its place

    def mask(self, static: Any, where: Any) -> Any:
        return where  # a pytree of bools with a dict keyed by variable path (or one bool) per model

    def mask_paths(self, params: Any) -> list[str]:
        """The paths a ``where`` callable is given: ``['model']['sequential/dense/kernel']``."""
        return leaf_paths(params)

    def describe(self, value: Any) -> str:
        return f"a {type(value).__name__} holding Keras models or variables"

    def difference(self, static: Any, value: Any) -> str | None:
        """The first model or variable that is another object than the prepared one, or a model
        that holds other variables."""
        spec, where, layouts = self.split(value)[0]
        if spec != static[0]:
            return None  # another structure: the pytree's own message says where
        # where each one is in the pytree ("" for a model passed alone: no place to name)
        places = [f" at {path}" if path else "" for path in leaf_paths(unflatten(spec, list(range(spec.num_leaves))))]
        for index, (node, trainable, other), (then, then_trainable, then_other) in zip(where, layouts, static[2]):
            kind = "model" if _is_keras_layer(node) else "variable"
            name = node.name if kind == "model" else node.path
            then_name = then.name if _is_keras_layer(then) else then.path
            if node is not then:
                return f"the Keras {kind}{places[index]} is {name!r}, prepared with {then_name!r} (another object)"
            if (trainable, other) != (then_trainable, then_other):
                return f"the Keras model {name!r}{places[index]} holds other variables than when it was prepared"
        return None


@attrs.frozen(eq=False)
class KerasModel(KerasModelsInPytree):
    """A Keras 3 layer or model passed as an argument of its own, on the JAX backend: the pytree
    whose root is the model, so its values are the dict of its trainable variables' values keyed
    by path, as ``model.stateless_call`` takes them. A Keras model cannot be rebuilt around other
    values; inside f its variables read the call's values through a ``StatelessScope``."""

    def mask_paths(self, params: Any) -> list[str]:
        """The paths a ``where`` callable is given: each variable's own (``"sequential/dense/kernel"``)."""
        return [path[2:-2] for path in leaf_paths(params)]  # "['a/b/kernel']": the key, in flatten order

    def describe(self, model: Any) -> str:
        return f"a Keras {type(model).__name__}"


def _variables_of(held: list[Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Each model's trainable and other variables keyed by path, a variable an earlier model or
    variable leaf holds too left out (it is that one's); a variable leaf is its own one entry of
    the first dict."""
    seen: set[int] = set()
    found = []
    for node in held:
        if _is_keras_layer(node):
            trainable = _by_path(v for v in node.trainable_variables if id(v) not in seen)
            other = _by_path(v for v in node.non_trainable_variables if id(v) not in seen)
        else:
            trainable, other = ({node.path: node} if id(node) not in seen else {}), {}
        seen.update(id(v) for v in (*trainable.values(), *other.values()))
        found.append((trainable, other))
    return found


def _by_path(variables: Any) -> dict[str, Any]:
    """Keras variables keyed by path, each once (a variable two layers share is one parameter)."""
    keyed: dict[str, Any] = {}
    seen: set[int] = set()
    for variable in variables:
        if id(variable) not in seen:
            seen.add(id(variable))
            path = variable.path
            keyed[path if path not in keyed else f"{path}#{len(keyed)}"] = variable
    return keyed


def _keras_on_jax(value: Any) -> bool:
    return _is_keras_layer(value) and sys.modules["keras"].backend.backend() == "jax"


def _keras_on_jax_loaded() -> bool:
    # a layer of a library not imported cannot be in the value
    return "keras.src.layers.layer" in sys.modules and sys.modules["keras"].backend.backend() == "jax"


@attrs.frozen(eq=False)
class PenzaiVariables:
    """Penzai: a pytree holding ``pz.Parameter`` and ``pz.StateVariable`` objects (a ``pz.nn``
    model). Variables are mutable Python objects, leaves to JAX, so a plain pytree split
    would take a model for one without arrays (and compile its parameters in as static
    values). Split as Penzai's own recipe does: ``pz.unbind_variables`` leaves the model with
    slots (its other arrays stay leaves of it), the Parameters' frozen values are the
    differentiated part, the other variables' frozen values are data; f gets the model bound
    to fresh copies of the variables."""

    library = "penzai"

    def split(self, value: Any) -> tuple[Any, Any, Any]:
        variables = sys.modules["penzai.core.variables"]
        unbound, found = variables.unbind_variables(value)  # a label two variables share is Penzai's error
        params = tuple(var.freeze() for var in found if isinstance(var, variables.Parameter))
        others = tuple(var.freeze() for var in found if not isinstance(var, variables.Parameter))
        # The static part, what a prepared call is checked against first: each variable's kind,
        # label and layout, so that a model of other sizes is told by the variable that changed.
        layout = tuple((type(var).__name__.removesuffix("Value"), var.label, _layout(var.value)) for var in (*params, *others))
        return layout, _floats_as_arrays(params), (unbound, others)

    def merge(self, static: Any, params: Any, rest: Any) -> Any:
        unbound, others = rest
        fresh = [value.unfreeze_as_copy() for value in (*params, *others)]
        return sys.modules["penzai.core.variables"].bind_variables(unbound, fresh)

    def result(self, static: Any, params: Any) -> Any:
        return params  # a tuple of pz.ParameterValue, as jax.grad of pz.unbind_params(model, freeze=True)[1]

    def mask(self, static: Any, where: Any) -> Any:
        """A ``where=`` pytree of bools: one per Parameter, in ``pz.unbind_params`` order."""
        return where

    def mask_paths(self, params: Any) -> list[str]:
        """The paths a ``where`` callable is given: each Parameter's label (``"mlp/Linear_0.weights"``),
        followed by the path inside its value where that is a pytree of several arrays."""
        paths = []
        for param in params:
            inner = leaf_paths(param.value)
            if len(inner) == 1:
                inner = [""]  # one array (a NamedArray's data too): the label names it
            paths += [f"{param.label}{path}" for path in inner]
        return paths

    def describe(self, value: Any) -> str:
        return f"a {type(value).__name__} holding Penzai variables"

    def active_refusal(self, value: Any, rest: Any) -> str | None:
        """Why ``value`` (split, its ``rest``) cannot be Active, or None: floating arrays outside
        any variable, where ``value`` is a container of Penzai models rather than a model, would be
        data here, where the pytree rule differentiates them. Inside a model (a Penzai ``Struct``)
        such arrays are constants, as Penzai's own trainer has them: only Parameters are trained."""
        if isinstance(value, sys.modules["penzai.core.struct"].Struct):
            return None
        unbound = rest[0]
        loose = [
            path
            for path, leaf in zip(leaf_paths(unbound), flatten(unbound)[0])
            if hasattr(leaf, "dtype") and hasattr(leaf, "shape") and np.dtype(leaf.dtype).kind == "f"
        ]
        if not loose:
            return None
        return (
            f"holds Penzai variables, which are differentiated in their pz.Parameters (the result is the tuple "
            f"of pz.ParameterValue), and floating arrays outside them at {', '.join(loose[:3])}"
            f"{' ...' if len(loose) > 3 else ''}, which that result has no place for. Pass those arrays as an "
            f"Active argument of their own (or as Constant data), and the models alone in this one."
        )

    def difference(self, static: Any, value: Any) -> str | None:
        """The first variable whose kind, label or layout differs from the prepared ones."""
        now = self.split(value)[0]
        for (kind, label, layout), (then_kind, then_label, then_layout) in zip(now, static):
            if (kind, label) != (then_kind, then_label):
                return f"it holds the {kind} {label!r} where the prepared one held the {then_kind} {then_label!r}"
            if layout != then_layout:
                now_text, then_text = _describe_layout(layout), _describe_layout(then_layout)
                if now_text == then_text:  # the same arrays in another structure
                    now_text, then_text = str(layout[0]), str(then_layout[0])
                return f"its {kind} {label!r} holds {now_text}, prepared with {then_text}"
        if len(now) != len(static):
            return f"it holds {len(now)} variables, the prepared one {len(static)}"
        return None


def _layout(value: Any) -> tuple[Any, ...]:
    """A variable value's structure, its arrays' shapes and dtypes, and its named axes (a Penzai
    NamedArray's): hashable and comparable."""
    leaves, structure = flatten(value)
    shapes = tuple((tuple(getattr(leaf, "shape", ())), str(getattr(leaf, "dtype", type(leaf).__name__))) for leaf in leaves)
    named = getattr(value, "named_shape", None)
    return structure, shapes, tuple(dict(named).items()) if isinstance(named, Mapping) else None


def _describe_layout(layout: tuple[Any, ...]) -> str:
    structure, shapes, named = layout
    arrays = ", ".join(f"{dtype}{list(shape)}" for shape, dtype in shapes) or "no array"
    return arrays + (f" (named axes {', '.join(f'{name}={size}' for name, size in named)})" if named else "")


_NNX = NNXModule()
_NNX_IN_PYTREE = NNXModulesInPytree()
_KERAS = KerasModel()
_KERAS_IN_PYTREE = KerasModelsInPytree()
_PENZAI = PenzaiVariables()


def _is_penzai_variable(leaf: Any) -> bool:
    return isinstance(leaf, sys.modules["penzai.core.variables"].AbstractVariable)


def adapter_for(value: Any) -> NNXModule | NNXModulesInPytree | KerasModel | KerasModelsInPytree | PenzaiVariables | None:
    """The convention that splits ``value`` itself (not a plain pytree), or None."""
    if _keras_on_jax(value):
        return _KERAS
    nnx = sys.modules.get("flax.nnx")  # a model of a library not imported cannot be this one
    if nnx is not None and isinstance(value, _nnx_object_type(nnx)):
        return _NNX
    # The libraries imported (a model of one not imported cannot be in the value), each with what
    # marks its objects; one flatten of the value finds which of them it holds.
    kinds = [
        (adapter, kind)
        for adapter, kind, loaded in (
            (_KERAS_IN_PYTREE, _is_keras_object, _keras_on_jax_loaded()),
            (_NNX_IN_PYTREE, _is_nnx_module, nnx is not None),
            (_PENZAI, _is_penzai_variable, "penzai.core.variables" in sys.modules),
        )
        if loaded
    ]
    if not kinds:
        return None
    leaves = flatten(value, is_leaf=lambda node: any(kind(node) for _, kind in kinds))[0]
    found = [adapter for adapter, kind in kinds if any(map(kind, leaves))]
    if len(found) > 1:
        # Each convention splits its own objects and would leave the others' as static leaves:
        # their weights silently not differentiated, or stale in a prepared call.
        names = {"keras": "Keras models or variables", "flax.nnx": "Flax NNX modules", "penzai": "Penzai variables"}
        raise TypeError(
            f"activity: this {type(value).__name__} holds {' and '.join(names[a.library] for a in found)}, which "
            f"activity splits into their weights each by its own library's convention, not both in one "
            f"argument. Pass each library's models in an argument of their own, e.g. "
            f"gradient(f, Active(keras_part), Active(nnx_part))."
        )
    return found[0] if found else None


__all__ = ["is_python_number", "adapter_for", "Bound", "KerasModel", "KerasModelsInPytree", "NNXModule", "NNXModulesInPytree", "PenzaiVariables"]

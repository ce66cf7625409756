"""From annotated arguments to flat leaves and back.

A `Problem` records, for one call signature, what each leaf of each argument
is: differentiated (``DIFF``), a module whose trainable parameters are
differentiated (``MODULE``), an array passed through the transform
(``DYNAMIC``), scratch space (``CACHE``) or a static Python value
(``STATIC``). With it, the generic layer works on two flat tuples: ``xs``, the
differentiated leaves, and ``ctx``, everything else that changes per call.
`Problem.function` rebuilds ``f``'s arguments from them inside the transform.
"""

from __future__ import annotations

import collections.abc
import contextlib
import difflib
import sys
import warnings
from typing import Any, Callable, Sequence, overload

import attrs
import numpy as np

from . import _arrays as arrays
from ._annotations import Active, Annotation, Cache, Constant, is_predicate
from ._conventions import Bound, adapter_for, is_python_number
from ._errors import RAISED_BY_F, UnsupportedError, add_note, caller_stacklevel, short_repr
from ._tree import LEAF, flatten, leaf_parents, leaf_paths, same_static_value, structure_difference, unflatten

DIFF, MODULE, DYNAMIC, CACHE, STATIC = "diff", "module", "dynamic", "cache", "static"

_WRAPPERS = "Active(x) to differentiate it, Constant(x) for data, or Cache(x) for scratch space f may overwrite"


def a(noun: str) -> str:
    """``noun`` with its indefinite article: "a float", "an Active"."""
    return ("an " if noun[:1].lower() in "aeiou" else "a ") + noun


def describe_type(value: Any) -> str:
    """What ``value`` is, in the words of its framework, with its article: "a jax array",
    "a torch tensor", "a torch.nn.Module (Linear)", "a Python int" (for messages; class
    names such as ``ArrayImpl`` mean nothing to a user).

    >>> import numpy as np
    >>> describe_type(np.ones(2)), describe_type(np.float32(1.0)), describe_type(2), describe_type(None)
    ('a numpy array', 'a numpy float32 scalar', 'a Python int', 'None')
    """
    if value is None:
        return "None"
    if isinstance(value, np.generic):  # before float: np.float64 is a float
        return f"a numpy {value.dtype} scalar"
    if isinstance(value, np.ndarray):
        return "a numpy array"
    if isinstance(value, (bool, int, float, complex)):
        return f"a Python {type(value).__name__}"
    if arrays.is_jax(value):
        return "a jax array"
    if arrays.is_jax_placeholder(value):
        return "a jax.ShapeDtypeStruct placeholder"
    if arrays.is_torch(value):
        return "a torch.nn.Parameter" if isinstance(value, sys.modules["torch"].nn.Parameter) else "a torch tensor"
    if arrays.is_torch_module(value):
        cls = type(value)
        builtin = cls.__module__.startswith("torch.nn.")  # a layer users know by its torch.nn name
        return f"a torch.nn.{cls.__name__}" if builtin else f"a torch.nn.Module ({cls.__name__})"
    return a(type(value).__name__)


def ordinal(position: int) -> str:
    return f"argument {position} (counting from 0 after f)"


@attrs.frozen
class Arguments:
    """One call's annotated arguments: positional ones first, then keyword ones in the order given."""

    kinds: tuple[str, ...]
    values: tuple[Any, ...]
    wheres: tuple[Any, ...]  # each Active's ``where`` (None: all of it; None for other kinds)
    keywords: tuple[str, ...] = ()  # the names of the last ``len(keywords)`` arguments, passed by keyword


def parse_call(op_name: str, f: Any, args: Sequence[Any], keywords: dict[str, Any] | None = None) -> Arguments:
    """Check the annotations of ``args`` and of the keyword arguments for ``f``."""
    keywords = keywords or {}
    for name, arg in keywords.items():
        if not isinstance(arg, Annotation) or type(arg) is Annotation:
            raise TypeError(
                f"activity.{op_name}: the keyword argument {name}= is unannotated: {describe_type(arg)}. "
                f"A keyword argument for f is annotated too: wrap it as {_WRAPPERS}."
            )
    every = (*args, *keywords.values())
    kinds, values = parse_arguments(op_name, f, args, every)
    return Arguments(kinds, values, tuple(getattr(arg, "where", None) for arg in every), tuple(keywords))


def parse_arguments(
    op_name: str, f: Any, args: Sequence[Any], every: Sequence[Any] | None = None
) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    """Check the annotations of ``args``; return their kinds and the wrapped values (of ``every``
    argument: the positional ones and then the keyword ones, when given)."""
    if not callable(f):
        got = f"{describe_type(f)}(...), {short_repr(f)}" if isinstance(f, Annotation) else f"{describe_type(f)}, {short_repr(f)}"
        swapped = any(callable(arg) and not isinstance(arg, Annotation) for arg in args)
        raise TypeError(
            f"activity.{op_name}: the first argument must be the function f; got {got}. "
            + ("f seems to come later among the arguments (swapped?): " if swapped else "")
            + f"pass f first, then its annotated arguments: activity.{op_name}(f, Active(x), ...)."
        )
    every = args if every is None else every
    if not every:
        raise TypeError(
            f"activity.{op_name}(f) got no arguments for f. Pass each argument annotated: "
            f"activity.{op_name}(f, Active(x), Constant(data), ...)."
        )
    for position, arg in enumerate(args):
        if not isinstance(arg, Annotation) or type(arg) is Annotation:
            raise TypeError(
                f"activity.{op_name}: {ordinal(position)} is unannotated: {describe_type(arg)}. "
                f"Wrap it as {_WRAPPERS}."
            )
    for position, arg in enumerate(every):
        if arg.kind == "active" and isinstance(arg.value, collections.abc.Iterator):
            which = ordinal(position) if position < len(args) else "a keyword argument"
            raise TypeError(f"activity.{op_name}: {which} is {_active_iterator(arg.value)}")
    kinds = tuple(arg.kind for arg in every)
    if "active" not in kinds:
        raise TypeError(
            f"activity.{op_name}: no argument is Active, so there is nothing to differentiate. "
            f"Mark the argument(s) to differentiate with Active(x)."
        )
    return kinds, tuple(arg.value for arg in every)


def _active_iterator(iterator: Any) -> str:
    """Why an Active iterator is refused and what to pass: an iterator is consumed by its first
    reading, and a backend reads its arguments more than once."""
    code = getattr(iterator, "gi_code", None)
    frame = getattr(iterator, "gi_frame", None)
    owner = frame.f_locals.get("self") if frame is not None else None
    if code is not None and code.co_name in ("parameters", "named_parameters") and arrays.is_torch_module(owner):
        return (
            f"Active(model.{code.co_name}()), a generator, which can be read only once. Pass the module "
            f"itself, Active(model): its trainable parameters are differentiated, and the result is a dict "
            f"keyed like named_parameters()."
        )
    return (
        f"Active of {describe_type(iterator)}, an iterator, which can be read only once. Pass a list or a "
        f"tuple (Active(list(values))), or for a torch module's parameters the module itself, Active(model)."
    )


def _nothing_to_differentiate(value: Any, leaves: Sequence[Any]) -> str:
    """Why an Active argument has nothing to differentiate, and what to do (a message's end)."""
    modules = [leaf for leaf in leaves if arrays.is_torch_module(leaf)]
    if modules and any(True for module in modules for _ in module.parameters()):
        return (
            f"is Active({type(modules[0]).__name__}), but every parameter of that torch.nn.Module has "
            f"requires_grad=False; only parameters with requires_grad=True are differentiated. Call "
            f"model.requires_grad_(True) to differentiate them, or mark it Constant(model)."
        )
    if modules:
        return f"is Active({type(modules[0]).__name__}), a torch.nn.Module without parameters. Mark it Constant(model)."
    keras = _keras_object(leaves)
    if keras is not None:
        return (
            f"is Active but holds {keras}, whose values Keras keeps in its variables, out of reach of a "
            f"pytree. Pass the Keras model or layer itself, as its own argument: Active(model) differentiates "
            f"its trainable variables (the result is keyed by their paths), Constant(model) reads their "
            f"current values on every call; or pass the values, Active([v.value for v in model.trainable_variables]), "
            f"to an f that calls model.stateless_call."
        )
    what = describe_type(value) + (f" of dtype {value.dtype}" if arrays.is_array(value) else "")
    advice = float_advice(value)
    return (
        f"is Active but holds no floating-point value to differentiate ({what}). Mark it Constant(...) "
        + (f"instead, or {advice}." if advice else
           "instead, or pass float arrays (a Python number inside a pytree is a static hyper-parameter: "
           "wrap it with jnp.asarray(...) or torch.tensor(...) to differentiate it).")
    )


def _keras_object(leaves: Sequence[Any]) -> str | None:
    """How to name a Keras variable or layer among ``leaves``, or None."""
    variables, layer = sys.modules.get("keras.src.backend.common.variables"), sys.modules.get("keras.src.layers.layer")
    for leaf in leaves:
        if variables is not None and isinstance(leaf, variables.Variable):
            return f"a Keras Variable ({leaf.path})"
        if layer is not None and isinstance(leaf, layer.Layer):
            return f"a Keras {type(leaf).__name__} inside a pytree"
    return None


def float_advice(value: Any) -> str | None:
    """How to make ``value`` floating point, in its own framework's words (None: no simple way):
    a Python int is written as a float, an array converted by its own method."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and not isinstance(value, np.generic):
        return f"write it as a float ({float(value)!r}, or float(x))"
    if arrays.is_torch(value):
        return "convert it with .float() (or .to(torch.float64))"
    if arrays.is_array(value):
        return "convert it with .astype(float)"
    return None


HAS_AUX = frozenset({"gradient", "value_and_gradient", "jacobian", "value_and_jacobian"})
"""The operators that take ``has_aux=True``."""


def _is_scalar(value: Any) -> bool:
    return (arrays.is_array(value) or isinstance(value, float)) and arrays.shape(value) == ()


def _describe_output(value: Any) -> str:
    """One part of f's output, for messages: "a scalar", "an array of shape (3,)", "a dict"."""
    if _is_scalar(value):
        return "a scalar"
    if arrays.is_array(value):
        return f"an array of shape {arrays.shape(value)}"
    return describe_type(value)


def array_meta(leaf: Any) -> tuple[Any, ...]:
    """What a prepared operator needs unchanged in an array: framework, shape, dtype (and torch device)."""
    if arrays.is_torch(leaf):
        return ("torch", tuple(leaf.shape), leaf.dtype, leaf.device)  # a meta-device placeholder: device meta
    if not arrays.is_array(leaf):
        if arrays.is_jax_placeholder(leaf):  # equal to no array's meta: a call with a placeholder is refused
            return ("placeholder", "jax.ShapeDtypeStruct", tuple(leaf.shape), str(leaf.dtype))
        return ("static", leaf)
    return (arrays.framework(leaf), arrays.shape(leaf), str(leaf.dtype), None)  # JAX placement is not checked


def _describe(meta: tuple[Any, ...]) -> str:
    if meta[0] == "static":
        return f"the value {short_repr(meta[1])}"  # repr tells 2.0 from 2 and "2", which differ here
    if meta[0] == "placeholder":
        return f"a placeholder ({meta[1]} of shape {meta[2]} and dtype {meta[3]})"
    if meta[0] == "module":
        return f"a {meta[1]} module"  # what differs inside it is `module_difference`'s
    framework, shape, dtype, device = meta
    where = f" on {device}" if device else ""
    if _any_device(meta):
        where = " (prepared from a meta-device placeholder: any device)"
    return f"a {'torch tensor' if framework == 'torch' else framework + ' array'} of shape {shape} and dtype {dtype}{where}"


def module_difference(expected: tuple[Any, ...], actual: tuple[Any, ...], module: Any = None, limit: int = 3) -> str:
    """What differs between two torch module layouts (`describe_module`'s), by parameter and
    buffer name (the first ``limit`` differences); ``module``, the one of ``actual``, names
    its submodules when only their types differ."""
    prepared = {entry[0]: entry for entry in expected if isinstance(entry, tuple)}
    given = {entry[0]: entry for entry in actual if isinstance(entry, tuple)}
    changes = []
    for name, entry in prepared.items():
        other = given.get(name)
        if other is None:
            changes.append(f"{_tensor_kind(entry)} {name!r} is missing")
        elif len(other) != len(entry):
            changes.append(f"{name!r} is a {_tensor_kind(other)}, prepared as a {_tensor_kind(entry)}")
        elif not _same_layout_entry(entry, other):
            fields = zip(("shape", "dtype", "device", "requires_grad"), entry[1:], other[1:])
            changed = [
                f"{field} {_shown(x)}, got {_shown(y)}"
                for field, x, y in fields
                if x != y and getattr(x, "type", None) != "meta"  # a meta-device placeholder fixes no device
            ]
            changes.append(f"{_tensor_kind(entry)} {name!r}: expected " + "; expected ".join(changed))
    changes += [f"{_tensor_kind(entry)} {name!r} is new" for name, entry in given.items() if name not in prepared]
    if not changes:
        types_e = [entry for entry in expected if isinstance(entry, type)]
        types_a = [entry for entry in actual if isinstance(entry, type)]
        names = [name or "(the module itself)" for name, _ in module.named_modules()] if module is not None else []
        for index, (type_e, type_a) in enumerate(zip(types_e, types_a)):
            if type_e is not type_a:
                where = repr(names[index]) if index < len(names) else f"number {index}"
                changes.append(f"submodule {where} is a {type_a.__name__}, prepared as a {type_e.__name__}")
        if len(types_e) != len(types_a):
            changes.append(f"it has {len(types_a)} submodules, prepared with {len(types_e)}")
    if not changes:
        return "its parameters and buffers are laid out differently"
    more = f"; and {len(changes) - limit} more" if len(changes) > limit else ""
    return "; ".join(changes[:limit]) + more


def _tensor_kind(entry: tuple[Any, ...]) -> str:
    return "parameter" if len(entry) == 5 else "buffer"  # see `describe_module`'s layout


def _shown(value: Any) -> str:
    return str(tuple(value)) if type(value).__name__ == "Size" else str(value)


def _any_device(meta: tuple[Any, ...]) -> bool:
    """Whether ``meta`` is a torch placeholder's: a tensor on the meta device fixes shape and dtype only."""
    return meta[0] == "torch" and getattr(meta[3], "type", None) == "meta"


@attrs.define
class Traced:
    """What one run of ``f`` revealed: its output structure and the static part of ``aux``."""

    out_spec: Any = None
    aux_static: Any = None

    def output(self, ys: Sequence[Any]) -> Any:
        return unflatten(self.out_spec, list(ys))

    def aux(self, aux_dynamic: Any) -> Any:
        return combine(aux_dynamic, self.aux_static)


def partition(tree: Any) -> tuple[list[Any], tuple[Any, ...]]:
    """Split ``tree`` into its array leaves and the rest (structure and non-array leaves)."""
    leaves, spec = flatten(tree)
    mask = tuple(arrays.is_array(leaf) for leaf in leaves)
    dynamic = [leaf for leaf, is_arr in zip(leaves, mask) if is_arr]
    static = [None if is_arr else leaf for leaf, is_arr in zip(leaves, mask)]
    return dynamic, (spec, mask, static)


def combine(dynamic: Sequence[Any], static: tuple[Any, ...]) -> Any:
    spec, mask, static_leaves = static
    it = iter(dynamic)
    return unflatten(spec, [next(it) if is_arr else leaf for is_arr, leaf in zip(mask, static_leaves)])


class Problem:
    """The kinds, structures and leaf roles of one call's arguments."""

    def __init__(
        self,
        op_name: str,
        kinds: tuple[str, ...],
        values: tuple[Any, ...],
        backend: Any,
        wheres: tuple[Any, ...] | None = None,
        keywords: tuple[str, ...] = (),
    ):
        self.op_name = op_name
        self.kinds = kinds
        self.backend = backend
        self.keywords = keywords  # the last len(keywords) arguments are passed to f by these names
        self.n_positional = len(kinds) - len(keywords)
        self.wheres = tuple(wheres) if wheres is not None else (None,) * len(kinds)
        # per argument: None (all of it differentiated), or what its `where` selects (see `selection`)
        self.selections: list[tuple[Any, ...] | None] = []
        self.specs: list[Any] = []
        self.roles: list[tuple[str, ...]] = []
        self.statics: list[tuple[Any, ...]] = []
        self.signature: list[tuple[Any, ...]] = []
        self.diff_shapes: list[tuple[int, ...]] = []  # shapes of the flat differentiated leaves
        self.diff_dtypes: list[Any] = []
        self.diff_frameworks: set[str | None] = set()
        self.diff_framework_of: dict[int, str | None] = {}  # flat index -> framework (modules: torch)
        self.module_names: dict[tuple[int, int], list[str]] = {}
        self.module_unselected: dict[tuple[int, int], list[str]] = {}  # a where= left them out
        self._described: dict[tuple[int, int], Any] = {}  # the last description of each module argument
        self._watched = False  # whether f has run on these arguments (see `call`)
        self.forward_writes_checked = False  # torch: whether a forward-mode f ran on copies (`AutoTorch.jvp`)
        self._hook_handles: Any = None  # torch.utils.hooks.RemovableHandle, once f has run
        self._parametrize: Any = None  # torch.nn.utils.parametrize, once f has run on modules (see `call`)
        self.arrays_only: bool = True  # every leaf of every argument is an array: a backend may take them whole
        # position -> (convention, its static part, number of trainable leaves, their structure), for
        # an argument a model library splits itself (a Flax NNX module); see _conventions.
        self.adapted: dict[int, tuple[Any, ...]] = {}
        self._binds = False  # an adapter's merge gives f the user's object, bound while f runs (`Bound`)
        for position, (kind, value) in enumerate(zip(kinds, values)):
            self._add_argument(position, kind, value, self.wheres[position])
        self.active_positions: tuple[int, ...] = tuple(i for i, k in enumerate(kinds) if k == "active")
        self.bare: tuple[bool, ...] = tuple(spec.is_leaf() for spec in self.specs)  # the argument is one leaf, not a tree
        # the type of each one-leaf argument (None for trees): a value of that type is that leaf
        self.bare_types: tuple[type[Any] | None, ...] = tuple(type(value) if bare else None for value, bare in zip(values, self.bare))

    def label(self, position: int) -> str:
        """How messages name an argument: "argument 1 (counting from 0 after f)" or "keyword argument scale="."""
        if position >= self.n_positional:
            return f"keyword argument {self.keywords[position - self.n_positional]}="
        return ordinal(position)

    # ------------------------------------------------------------------ parsing

    def selection(self, position: int, value: Any, where: Any, adapted: tuple[Any, Any] | None = None) -> tuple[Any, ...] | None:
        """What ``Active(value, where=where)`` differentiates: None for all of it, else one entry
        per leaf: a bool for a leaf that would be differentiated, the selected parameter names
        for a torch module, None for the others. Checked: a mask that selects nothing, has
        the wrong structure, or answers anything but a bool is a TypeError naming the argument.
        ``adapted``: `_adapted_split` of ``value``, where the caller has it."""
        if where is None:
            return None
        label = f"activity.{self.op_name}: {self.label(position)} (Active with where=)"
        predicate = is_predicate(where)
        adapter, split = adapted if adapted is not None else _adapted_split(value)
        if adapter is None:
            leaves, spec = flatten(value)
            tree, trainable = value, len(leaves)
        else:
            static, params, rest = split
            tree, trainable = params, len(flatten(params)[0])
            leaves, spec = flatten((params, rest))
            where = where if predicate else adapter.mask(static, where)
        in_tree = not spec.is_leaf()
        candidate = [
            arrays.is_torch_module(leaf)
            or _differentiable(leaf, index, trainable, in_tree)
            or _complex_parameter(leaf, index, trainable, in_tree)  # asked too: selected, it is refused
            for index, leaf in enumerate(leaves)
        ]
        # The paths a `where` callable is given: as messages print them, or as the model library
        # names its parameters (an NNX state's paths, Keras variables' paths, Penzai labels); only
        # the parameters' leaves, the first `trainable`, are ever candidates.
        paths = [""] if not in_tree else leaf_paths(tree) if adapter is None else adapter.mask_paths(tree)
        if predicate:
            marks: list[Any] = [None] * len(leaves)
        else:
            marks = _broadcast_mask(where, tree, value, label)
        selected: list[Any] = []
        asked: list[str] = []  # the paths where is given, for the message if it selects nothing
        for index, (leaf, is_candidate) in enumerate(zip(leaves, candidate)):
            if not is_candidate:
                selected.append(None)
            elif arrays.is_torch_module(leaf):
                described = self.backend.describe_module(leaf)
                names, named = described.names, dict(zip(described.names, described.params))
                prefix = paths[index] + "." if paths[index] else ""
                asked += [prefix + name for name in names]
                if predicate:
                    chosen = [name for name in names if _answer(where, prefix + name, named[name], label)]
                else:
                    mark = _module_mask(marks[index], names, leaf, label)
                    chosen = [name for name in names if _module_mark(mark, name, label)]
                selected.append(tuple(chosen))
            elif predicate:
                asked.append(paths[index])
                selected.append(_answer(where, paths[index], leaf, label))
            else:
                asked.append(paths[index])
                selected.append(bool(marks[index]))
        if not any(selected):
            # an NNX module's own variable types are data, out of where='s reach: say how to reach them
            note = _data_note(adapter, split)
            raise TypeError(
                f"{label} selects nothing to differentiate. Mark the argument Constant(...) if none of it is "
                f"differentiated, or change where= (it is called as where(path, leaf) with paths such as "
                f"{asked[:3]})." + (f" {note}" if note else "")
            )
        return tuple(selected)

    def _add_argument(self, position: int, kind: str, value: Any, where: Any = None) -> None:
        adapter, split = _adapted_split(value)
        selection = self.selection(position, value, where, (adapter, split)) if kind == "active" else None
        self.selections.append(selection)
        if adapter is None:
            leaves, spec = flatten(value)
            trainable = len(leaves)
        else:
            static, params, rest = split
            refusal = adapter.active_refusal(value, rest) if kind == "active" and hasattr(adapter, "active_refusal") else None
            if refusal is not None:
                raise TypeError(f"activity.{self.op_name}: {self.label(position)} (Active) {refusal}")
            trainable_leaves, trainable_spec = flatten(params)
            trainable = len(trainable_leaves)
            self.adapted[position] = (adapter, static, trainable, trainable_spec)
            self._binds = self._binds or getattr(adapter, "binds", False)
            leaves, spec = flatten((params, rest))
        roles, statics, metas = [], [], []
        paths = None
        in_tree = not spec.is_leaf()
        for index, leaf in enumerate(leaves):
            # A complex leaf is refused where it would be differentiated: not where the model
            # library's convention (an NNX Variable that is no Param) or a where= leaves it constant.
            if arrays.dtype_kind(leaf) == "c" and (
                kind == "cache"
                or kind == "active"
                and _complex_parameter(leaf, index, trainable, in_tree)
                and (selection is None or bool(selection[index]))
            ):
                paths = paths or _paths_in_order(value, leaves, position in self.adapted)
                raise UnsupportedError(
                    f"activity.{self.op_name} on {self.backend!r}: {self.label(position)} ({kind}) holds a complex "
                    f"value at {paths[index] or 'its root'}; complex differentiation is not supported. "
                    f"Split it into real and imaginary parts."
                )
            if isinstance(leaf, Annotation):
                paths = paths or _paths_in_order(value, leaves, position in self.adapted)
                raise TypeError(
                    f"activity.{self.op_name}: {self.label(position)} ({kind.capitalize()}) holds a "
                    f"{type(leaf).__name__}(...) at {paths[index] or 'its root'}; annotations do not nest. "
                    f"Annotate each top-level argument once and pass plain values inside it."
                )
            meta: tuple[Any, ...]
            if arrays.is_torch_module(leaf):
                role = MODULE
                described = self.backend.describe_module(leaf)
                self._described[(position, index)] = described
                if selection is not None:
                    # a tangent may name the unselected parameters too (None or zeros there)
                    self.module_unselected[(position, index)] = [n for n in described.names if n not in selection[index]]
                    described = described.selecting(selection[index])
                    self._described[(position, index)] = described
                names, params = (described.names, described.params) if kind == "active" else ([], [])
                prefix = paths[index] + "." if paths and paths[index] else ""
                self._warn_of_gradient_hooks(position, [(prefix + n, p) for n, p in zip(names, params)])
                self.module_names[(position, index)] = names
                self.diff_shapes += [tuple(p.shape) for p in params]
                self.diff_dtypes += [p.dtype for p in params]
                meta = ("module", type(leaf).__name__, described.layout)
            elif (
                kind == "active"
                and _differentiable(leaf, index, trainable, in_tree)
                and (selection is None or selection[index])
            ):
                role = DIFF
                if getattr(leaf, "_backward_hooks", None):
                    self._warn_of_gradient_hooks(position, [((paths or leaf_paths(value))[index] or "its root", leaf)])
                leaf = self.backend.as_array(leaf)
                self.diff_shapes.append(arrays.shape(leaf))
                self.diff_dtypes.append(leaf.dtype)
                self.diff_frameworks.add(arrays.framework(leaf))
                self.diff_framework_of[len(self.diff_shapes) - 1] = arrays.framework(leaf)
                meta = self.backend.array_meta(leaf)
            elif kind == "cache":
                if not arrays.is_array(leaf):
                    paths = paths or _paths_in_order(value, leaves, position in self.adapted)
                    raise TypeError(
                        f"activity.{self.op_name}: {self.label(position)} is a Cache holding "
                        f"{describe_type(leaf)} at {paths[index] or 'its root'}. A Cache holds arrays "
                        f"(or a pytree of arrays) that f may overwrite; pass other values as Constant(...)."
                    )
                role, meta = CACHE, self.backend.array_meta(leaf)
            elif arrays.is_array(leaf):
                role, meta = DYNAMIC, self.backend.array_meta(leaf)
            else:
                role, meta = STATIC, ("static", leaf)
            self.arrays_only &= role != MODULE and arrays.is_array(leaf)
            roles.append(role)
            statics.append(leaf if role == STATIC else None)
            metas.append(meta)
        if kind == "active" and in_tree and adapter is None and where is None and any(type(leaf) is float for leaf in leaves):
            self._warn_of_static_numbers(position, value, spec, leaves)
        if kind == "active" and DIFF not in roles and not any(
            self.module_names.get((position, i)) for i, r in enumerate(roles) if r == MODULE
        ):
            note = _data_note(adapter, split)
            raise TypeError(
                f"activity.{self.op_name}: {self.label(position)} {_nothing_to_differentiate(value, leaves)}"
                + (f" {note}" if note else "")
            )
        self.specs.append(spec)
        self.roles.append(tuple(roles))
        self.statics.append(tuple(statics))
        self.signature.append((kind, spec, tuple(metas), selection))

    def _warn_of_static_numbers(self, position: int, value: Any, spec: Any, leaves: list[Any]) -> None:
        """A Python float next to arrays in a plain dict or list of an Active argument (``{"w": w,
        "lr": 0.1}``) is a static hyper-parameter and gets None, as Equinox's filters treat it: a
        user who meant to differentiate it is told so, once per structure. A float field of a
        model's own object (an Equinox module's ``Dropout.p``) is a hyper-parameter by that
        library's convention, and a whole ``Active(2.0)`` is differentiated: neither is told. Once
        per call site and structure, whatever the warning filters (a training loop is told once)."""
        parents = leaf_parents(value)
        found = [
            index
            for index, (leaf, parent) in enumerate(zip(leaves, parents))
            if type(leaf) is float and type(parent) in (dict, list) and _holds_arrays(parent)
        ]
        if not found:
            return
        paths = leaf_paths(value)
        level = caller_stacklevel()
        caller = sys._getframe(level - 1)  # the frame the warning points at: the user's call
        key = (caller.f_code.co_filename, caller.f_lineno, spec, tuple(paths[index] for index in found))
        try:
            if key in _WARNED_NUMBERS:
                return
            if len(_WARNED_NUMBERS) > 4096:  # bounded: a program that builds ever new structures
                _WARNED_NUMBERS.clear()
            _WARNED_NUMBERS.add(key)
        except TypeError:  # a structure that cannot be hashed: told each time
            pass
        shown = ", ".join(f"{paths[index]} = {short_repr(leaves[index], 20)}" for index in found[:3])
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        warnings.warn(
            f"activity.{self.op_name}: {self.label(position)} (Active) holds a Python float next to arrays at "
            f"{shown}{more}. A Python number inside a pytree is a static hyper-parameter: it is not "
            f"differentiated and gets None in the result. Pass it as its own Constant(...) argument to say "
            f"so, or as an array (jnp.asarray(x), torch.tensor(x)) to differentiate it.",
            UserWarning,
            stacklevel=level,
        )

    def _warn_of_gradient_hooks(self, position: int, named: list[tuple[str, Any]]) -> None:
        """Gradient hooks on differentiated torch tensors (``Tensor.register_hook``: clipping,
        masking embedding rows) are not applied: the results are f's derivatives, as torch.func
        computes them, where ``torch.autograd.grad`` and ``backward()`` pass the gradient through
        the hooks. Silently different numbers from those would be a trap: say so."""
        hooked = [name for name, tensor in named if getattr(tensor, "_backward_hooks", None)]
        if hooked:
            warnings.warn(
                f"activity.{self.op_name}: {self.label(position)} has gradient hooks (Tensor.register_hook) on "
                f"{', '.join(hooked)}, which activity does not apply: its results are f's derivatives, as "
                f"torch.func computes them, where torch.autograd.grad and backward() pass them through the "
                f"hooks. Apply the hook to the result yourself, or remove it (handle.remove()).",
                UserWarning,
                stacklevel=caller_stacklevel(),
            )

    def modules(self) -> list[Any]:
        """The torch modules of the arguments, as last described."""
        return [module for module in (d.module for d in self._described.values()) if module is not None]

    def parameter_without_values(self) -> str | None:
        """Where the first differentiated parameter of an Active module on the meta device is
        (for messages), or None: such a parameter holds no values to differentiate at."""
        for (position, _), described in self._described.items():
            if self.kinds[position] == "active":
                for name, param in zip(described.names, described.params):
                    if param.is_meta:
                        return f"{self.label(position)} is {a(type(described.module).__name__)} whose parameter '{name}'"
        return None

    # --------------------------------------------------------------- per call

    @overload
    def split(
        self, values: Sequence[Any], kinds: None = None, wheres: Sequence[Any] | None = None
    ) -> tuple[tuple[Any, ...], tuple[Any, ...]]: ...
    @overload
    def split(
        self, values: Sequence[Any], kinds: Sequence[str], wheres: Sequence[Any] | None = None
    ) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None: ...
    def split(
        self, values: Sequence[Any], kinds: Sequence[str] | None = None, wheres: Sequence[Any] | None = None
    ) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
        """The differentiated leaves and the per-call context leaves of ``values``.

        With ``kinds`` (and the Actives' ``wheres``), also check ``values`` against
        the prepared signature in the same pass, and return None on any difference
        (`explain_mismatch` then says what differs).
        """
        xs: list[Any] = []
        ctx: list[Any] = []
        check = kinds is not None
        as_array, meta_of = self.backend.as_array, self.backend.array_meta
        for position, (value, roles) in enumerate(zip(values, self.roles)):
            leaves: list[Any] | None
            if type(value) is self.bare_types[position]:
                leaves, spec = [value], LEAF  # a lone array or module, as prepared: no tree to walk
            elif position in self.adapted:
                leaves, spec = self._adapted_leaves(position, value, check)
                if leaves is None:
                    return None
            else:
                leaves, spec = flatten(value)
            active = self.kinds[position] == "active"
            if check:
                if kinds[position] != self.kinds[position] or spec != self.specs[position]:  # type: ignore[index]
                    return None
                if wheres is not None and not self._same_selection(position, value, wheres[position]):
                    return None
                metas = self.signature[position][2]
            for index, (leaf, role) in enumerate(zip(leaves, roles)):
                if role == STATIC:
                    if check and not _same_meta(metas[index], ("static", leaf)):
                        return None
                    continue
                if role == MODULE:
                    if not arrays.is_torch_module(leaf):
                        return None
                    previous = self._described.get((position, index))
                    described = self.backend.describe_module(leaf, previous)
                    if described is not previous:
                        if check and described.layout != metas[index][2]:
                            return None
                        described = self._selected_params(position, index, described)
                        self._described[(position, index)] = described  # a checked description, reused while it holds
                    if active:
                        xs.extend(described.params)
                    ctx.append(described)
                    continue
                if role == DIFF:
                    if check and not (arrays.is_array(leaf) or isinstance(leaf, float)):
                        return None
                    leaf = as_array(leaf)
                    xs.append(leaf)
                else:
                    ctx.append(leaf)
                if check and meta_of(leaf) != metas[index]:
                    return None
        return tuple(xs), tuple(ctx)

    def _selected_params(self, position: int, index: int, described: Any) -> Any:
        """A module's description, narrowed to the parameters its argument's ``where`` selects."""
        selection = self.selections[position]
        return described if selection is None else described.selecting(selection[index])

    def selection_of(self, position: int, value: Any, where: Any) -> tuple[Any, ...] | None:
        """`selection` of a call's ``where``; the prepared one when it is the prepared object
        (a raw value takes it), so a prepared call does not evaluate its mask again."""
        if where is self.wheres[position] and position < len(self.selections):
            return self.selections[position]
        return self.selection(position, value, where)

    def _same_selection(self, position: int, value: Any, where: Any) -> bool:
        if where is self.wheres[position]:
            return True
        if self.kinds[position] != "active":
            return where is None
        return self.selection(position, value, where) == self.selections[position]

    def check(self, values: Sequence[Any], kinds: Sequence[str], wheres: Sequence[Any] | None = None) -> tuple[Any, ...]:
        """The signature of ``values`` (for preparation checks and caches)."""
        signature = []
        wheres = self.wheres if wheres is None else wheres
        for position, (kind, value) in enumerate(zip(kinds, values)):
            selection = self.selection_of(position, value, wheres[position]) if kind == "active" else None
            leaves, spec = self._adapted_leaves(position, value, True) if position in self.adapted else flatten(value)
            trainable = self.adapted[position][2] if leaves is not None and position in self.adapted else None
            if leaves is None:  # not the prepared model's graph: a structure of its own
                leaves, spec = flatten(value)
            trainable = len(leaves) if trainable is None else trainable
            in_tree = not spec.is_leaf()
            metas = []
            for index, leaf in enumerate(leaves):
                if arrays.is_torch_module(leaf):
                    metas.append(("module", type(leaf).__name__, self.backend.describe_module(leaf).layout))
                elif (
                    kind == "active"
                    and _differentiable(leaf, index, trainable, in_tree)
                    and (selection is None or (index < len(selection) and selection[index]))
                ):  # as split sees it (converted); a Python number in a pytree stays a static value
                    metas.append(self.backend.array_meta(self.backend.as_array(leaf)))
                else:
                    metas.append(self.backend.array_meta(leaf))
            signature.append((kind, spec, tuple(metas), selection))
        return tuple(signature)

    def explain_mismatch(
        self, values: Sequence[Any], kinds: Sequence[str], wheres: Sequence[Any] | None = None
    ) -> str | None:
        """None if ``values`` match the prepared signature, else what differs, where."""
        if len(values) != len(self.kinds):
            return (
                f"prepared with {len(self.kinds)} argument(s) after f, called with {len(values)}. "
                f"Pass the same arguments in the same order."
            )
        got = self.check(values, kinds, wheres)
        for position, (expected, actual, value) in enumerate(zip(self.signature, got, values)):
            if expected[0] != actual[0]:
                return (
                    f"{self.label(position)}: prepared as {expected[0].capitalize()}, called as "
                    f"{actual[0].capitalize()}. Annotation kinds are fixed by prepare."
                )
            if expected[3] != actual[3]:
                return f"{self.label(position)}: {_mask_change(expected[3], actual[3])}"
            if position in self.adapted and self._adapted_leaves(position, value, True)[0] is None:
                adapter, prepared_static = self.adapted[position][:2]
                tell = getattr(adapter, "difference", None) if adapter_for(value) is adapter else None
                difference = tell(prepared_static, value) if tell is not None else None
                return (
                    f"{self.label(position)}: prepared for another model: {adapter.describe(value)} whose graph "
                    f"(submodules, attributes, variable types) differs from the prepared one"
                    f"{': ' + difference if difference else ''}."
                )
            if expected[1] != actual[1]:
                return f"{self.label(position)}: pytree structure changed: {structure_difference(expected[1], value)}."
            for index, (meta_e, meta_a) in enumerate(zip(expected[2], actual[2])):
                if not _same_meta(meta_e, meta_a):
                    path = self.leaf_path(position, value, index)
                    if meta_e[0] == meta_a[0] == "module" and meta_e[1] == meta_a[1]:
                        module = flatten(value)[0][index]
                        return (
                            f"{self.label(position)} at {path}: the {meta_e[1]} module differs from the prepared "
                            f"one: {module_difference(meta_e[2], meta_a[2], module)}."
                        )
                    return (
                        f"{self.label(position)} at {path}: expected {_describe(meta_e)}, got {_describe(meta_a)}."
                        f"{_static_number_hint(meta_e, meta_a)}{_static_identity_hint(meta_e, meta_a)}"
                    )
        return None

    def leaf_path(self, position: int, value: Any, index: int) -> str:
        """The path, for messages, of the leaf ``index`` of the signature in ``value``, an argument
        at ``position`` (the leaves of an NNX module are named where they sit in it)."""
        leaves = self._adapted_leaves(position, value, False)[0] if position in self.adapted else None
        paths = leaf_paths(value) if leaves is None else _paths_in_order(value, leaves, True)
        return (paths[index] if index < len(paths) else "") or "(the argument itself)"

    def _adapted_leaves(self, position: int, value: Any, check: bool) -> tuple[list[Any] | None, Any]:
        """The leaves of an argument a model library splits itself (see `_conventions`); None
        (with ``check``) where ``value`` is not a model of the prepared kind and graph."""
        adapter, static = self.adapted[position][:2]
        if adapter_for(value) is not adapter:
            return None, None
        new_static, params, rest = adapter.split(value)  # type: ignore[union-attr]
        if check and not _same_meta(("static", static), ("static", new_static)):
            return None, None
        return flatten((params, rest))

    # ------------------------------------------------------ inside the transform

    def function(
        self, f: Callable[..., Any], ctx: tuple[Any, ...], traced: Traced, *, has_aux: bool = False, scalar: bool = False
    ) -> Callable[[tuple[Any, ...]], tuple[tuple[Any, ...], Any]]:
        """``F(xs) -> (output leaves, dynamic part of aux)``: f with its arguments rebuilt from leaves."""
        op_name = self.op_name

        def F(xs: tuple[Any, ...]) -> tuple[tuple[Any, ...], Any]:
            out = self.call(f, self.rebuild(xs, ctx))
            aux_dynamic: Any
            if has_aux:
                if not (isinstance(out, tuple) and len(out) == 2):
                    raise ValueError(
                        f"activity.{op_name}(has_aux=True): f must return a pair (output, aux), got "
                        f"{_describe_output(out)}. Return (output, aux), or drop has_aux=True."
                    )
                out, aux = out
                aux_dynamic, traced.aux_static = partition(aux)
            else:
                aux_dynamic = ()  # torch.func accepts only tensors (and containers) as aux
            ys, traced.out_spec = self.output_leaves(out, scalar, has_aux=has_aux)
            return ys, aux_dynamic

        F.op_name = op_name  # type: ignore[attr-defined]  # for a backend's messages
        # For a backend that compiles F once per problem and calls it with each call's context.
        F.problem, F.ctx, F.traced = self, ctx, traced  # type: ignore[attr-defined]
        F.key = (f, (("has_aux", has_aux), ("scalar", scalar)))  # type: ignore[attr-defined]  # how to make it again
        return F

    def call(self, f: Callable[..., Any], values: Sequence[Any]) -> Any:
        """``f(*values)``, the keyword arguments by name; an error it raises keeps its type and
        traceback, with a note saying where. Where the arguments hold torch modules, hooks f
        registers on them are taken off again, and on the first call writes f makes to their
        tensors outside the tape are warned of (`backends._torch_modules.watched_call`), inside
        ``torch.nn.utils.parametrize.cached()`` f runs with a parametrization cache of its own
        (`backends._torch_parametrize`), with pyro loaded its parameter store holds the views'
        tensors while f runs (`backends._torch_pyro`), and Keras layers' variables read the views'
        tensors (`backends._torch_keras`). An argument an adapter binds (a Keras model on JAX)
        is the user's own object, reading the call's values while f runs."""
        if self._binds:
            with contextlib.ExitStack() as scopes:
                for value in values:
                    if type(value) is Bound:
                        scopes.enter_context(value.scope())
                return self._call_modules(f, [value.value if type(value) is Bound else value for value in values])
        return self._call_modules(f, values)

    def _call_modules(self, f: Callable[..., Any], values: Sequence[Any]) -> Any:
        described = self._described
        if described:
            parametrize = self._parametrize
            if parametrize is None:
                from .backends._torch_parametrize import parametrize_module

                parametrize = self._parametrize = parametrize_module()
            run = self._call
            if parametrize._cache_enabled:  # a `parametrize.cached()` block is open: f gets a cache of its own
                from .backends._torch_parametrize import apart_from_the_cache

                run = apart_from_the_cache(parametrize, run)
            pyro_runtime = sys.modules.get("pyro.poutine.runtime")
            if pyro_runtime is not None:  # pyro's global parameter store holds the views' tensors while f runs
                from .backends._torch_pyro import apart_from_the_param_store, holds_pyro_modules

                if holds_pyro_modules(described.values()):
                    run = apart_from_the_param_store(pyro_runtime._PYRO_PARAM_STORE, self._replaced(values), run)
            if "keras.src.layers.layer" in sys.modules:  # a Keras layer's variables read the views' tensors while f runs
                from .backends._torch_keras import in_stateless_scope, keras_variables

                variables = keras_variables(described.values())
                if variables:
                    run = in_stateless_scope(variables, self._replaced(values), run)
            if not self._watched:  # the first call: also the writes (a warning shows once per place anyway)
                watch = sys.modules["activity.backends._torch_modules"]
                self._hook_handles = watch.hook_handles()  # before the flag: another thread reads it then
                self._watched = True
                try:
                    return watch.watched_call(described, run, f, values, self.op_name, self.label, True)
                except BaseException:
                    # f stopped before any write it makes (torch.func refusing one, which the tape then
                    # runs): the next call is the first to look
                    self._watched = False
                    raise
            handles = self._hook_handles
            first = handles.next_id  # counts every hook torch registers
            try:
                return run(f, values)
            finally:
                if handles.next_id != first:
                    sys.modules["activity.backends._torch_modules"].forget_hooks_since(described.values(), first)
        return self._call(f, values)

    def _replaced(self, values: Sequence[Any]) -> dict[int, Any]:
        """``id(user's parameter) -> the view's tensor in its place``, over the described modules."""
        pairs = [(d.module, flatten(values[position])[0][index]) for (position, index), d in self._described.items()]
        return sys.modules["activity.backends._torch_modules"].replaced_parameters(pairs)  # type: ignore[no-any-return]

    def _call(self, f: Callable[..., Any], values: Sequence[Any]) -> Any:
        try:
            if self.keywords:
                n = self.n_positional
                return f(*values[:n], **dict(zip(self.keywords, values[n:])))
            return f(*values)
        except Exception as error:
            add_note(error, f"{RAISED_BY_F}{self.op_name} with backend {self.backend!r})")
            active = ", ".join(self.label(i) for i, kind in enumerate(self.kinds) if kind == "active")
            hint = self.backend.explain_error(error, active)
            if hint is not None:
                add_note(error, hint)
            raise

    def output_leaves(self, out: Any, scalar: bool, has_aux: bool = False) -> tuple[tuple[Any, ...], Any]:
        """The array leaves of f's output ``out`` (a float becomes an array) and its structure, checked
        (``has_aux``: ``out`` is the output part of f's ``(output, aux)``)."""
        if arrays.is_torch(out) and out.dtype.is_floating_point and not (scalar and out.dim()):
            return (out,), LEAF  # the usual torch output: nothing to check or convert
        if arrays.is_array(out):  # the usual output, without a tree walk
            ys, spec = [out], LEAF
        else:
            ys, spec = flatten(out)
        self._check_output(out, ys, scalar, has_aux)
        return tuple(map(self.backend.as_array, ys)), spec

    def _check_output(self, out: Any, ys: list[Any], scalar: bool, has_aux: bool = False) -> None:
        if not ys:
            raise TypeError(
                f"activity.{self.op_name}: f returned {short_repr(out)}, which holds no array. "
                f"f must return an array, a float, or a pytree of arrays."
            )
        for index, y in enumerate(ys):
            if not (arrays.is_array(y) or isinstance(y, float)) or arrays.dtype_kind(y) != "f":
                where = leaf_paths(out)[index] or "its output"
                raise TypeError(
                    f"activity.{self.op_name}: f returned {describe_type(y)} "
                    f"{'of dtype ' + str(y.dtype) + ' ' if hasattr(y, 'dtype') else ''}at {where}; "
                    f"outputs must be floating-point arrays or floats."
                )
        if scalar and (len(ys) != 1 or arrays.shape(ys[0]) != ()):
            if not has_aux and self.op_name in HAS_AUX and isinstance(out, tuple) and len(out) == 2 and _is_scalar(out[0]):
                raise ValueError(
                    f"activity.{self.op_name} needs f to return a scalar, but it returned a tuple of 2 "
                    f"(a scalar, {_describe_output(out[1])}). If the second is auxiliary output (returned "
                    f"alongside, not differentiated), pass has_aux=True; for two outputs, use activity.jacobian."
                )
            what = f"an array of shape {arrays.shape(ys[0])}" if len(ys) == 1 else f"a pytree of {len(ys)} arrays"
            if isinstance(out, (tuple, list)) and len(ys) > 1:
                what = f"a {type(out).__name__} of {len(out)} ({', '.join(map(_describe_output, out[:3]))}{', ...' if len(out) > 3 else ''})"
            raise ValueError(
                f"activity.{self.op_name} needs f to return a scalar, but it returned {what}. "
                f"Reduce the output (e.g. .sum() or .mean()), or use activity.jacobian for non-scalar outputs."
            )

    def rebuild(self, xs: tuple[Any, ...], ctx: tuple[Any, ...]) -> list[Any]:
        """``f``'s arguments, built from the flat leaves inside the current transform."""
        backend = self.backend
        if backend.copies_inputs:  # f may write into what it gets: every evaluation starts afresh
            xs, ctx = tuple(map(backend.fresh_input, xs)), tuple(map(backend.fresh_input, ctx))
        x_iter, c_iter = iter(xs), iter(ctx)
        values = []
        for position, (spec, roles, statics) in enumerate(zip(self.specs, self.roles, self.statics)):
            leaves = []
            for index, (role, static) in enumerate(zip(roles, statics)):
                if role == DIFF:
                    leaves.append(next(x_iter))
                elif role == STATIC:
                    leaves.append(static)
                elif role == CACHE:
                    leaves.append(backend.fresh_cache(next(c_iter), xs[0] if xs else None))
                elif role == DYNAMIC:
                    leaves.append(next(c_iter))
                else:
                    module = next(c_iter)
                    names = self.module_names[(position, index)]
                    params = [next(x_iter) for _ in names] if self.kinds[position] == "active" else None
                    leaves.append(backend.bind_module(module, params))
            value = leaves[0] if self.bare[position] else unflatten(spec, leaves)
            if position in self.adapted:
                adapter, static = self.adapted[position][:2]
                value = adapter.merge(static, *value)
            values.append(value)
        return values

    # ----------------------------------------------------------------- results

    def like_active(self, flat: Sequence[Any]) -> Any:
        """Arrange one value per differentiated leaf like the Active arguments (tuple if several)."""
        it = iter(flat)
        dtypes = iter(self.diff_dtypes)
        cast = self.backend.cast_result
        results = []
        for position in self.active_positions:
            leaves = []
            for index, role in enumerate(self.roles[position]):
                if role == DIFF:
                    leaves.append(cast(next(it), next(dtypes)))
                elif role == MODULE:
                    names = self.module_names[(position, index)]
                    leaves.append({name: cast(next(it), next(dtypes)) for name in names})
                else:
                    leaves.append(None)
            result = leaves[0] if self.bare[position] else unflatten(self.specs[position], leaves)
            if position in self.adapted:
                adapter, static = self.adapted[position][:2]
                result = adapter.result(static, result[0])
            results.append(result)
        return results[0] if len(results) == 1 else tuple(results)

    def flat_like_active(self, tree: Any, what: str) -> tuple[Any, ...]:
        """The inverse of `like_active` for a user's tangent: its differentiated leaves, checked."""
        parts = (tree,) if len(self.active_positions) == 1 else tree
        if len(self.active_positions) > 1 and (not isinstance(parts, (tuple, list)) or len(parts) != len(self.active_positions)):
            raise ValueError(
                f"activity.{self.op_name}: with {len(self.active_positions)} Active arguments, {what} must be a "
                f"tuple with one entry per Active argument, got {describe_type(tree)}."
            )
        flat = []
        shapes = iter(zip(self.diff_shapes, self.diff_dtypes, range(len(self.diff_shapes))))
        for number, (position, part) in enumerate(zip(self.active_positions, parts)):
            label = what if len(self.active_positions) == 1 else f"{what}[{number}]"
            spec = self.adapted[position][3] if position in self.adapted else self.specs[position]
            try:
                subtrees = spec.flatten_up_to(part)
            except (ValueError, TypeError):
                raise ValueError(
                    f"activity.{self.op_name}: {label} must have the structure of the Active {self.label(position)} "
                    f"(as its result has): {structure_difference(spec, part)}."
                ) from None
            for index, (role, sub) in enumerate(zip(self.roles[position], subtrees)):
                if role == DIFF:
                    items = [(index, "", sub)]
                elif role == MODULE:
                    names = self.module_names[(position, index)]
                    unselected = self.module_unselected.get((position, index), [])
                    if not isinstance(sub, dict) or not (set(names) <= set(sub) <= set(names) | set(unselected)):
                        masked = f" (selected by where=; the others may be left out)" if unselected else ""
                        raise ValueError(
                            f"activity.{self.op_name}: {label} for a module must be a dict keyed like its "
                            f"trainable named_parameters(){masked}: {names}."
                        )
                    items = [(index, f"[{name!r}]", sub[name]) for name in names]
                else:
                    continue
                for leaf_index, suffix, leaf in items:
                    shape, dtype, flat_index = next(shapes)
                    leaf = arrays.to_framework(leaf, self.diff_framework_of.get(flat_index, "torch"))
                    flat.append(self._checked_leaf(leaf, shape, dtype, label, position, leaf_index, suffix))
        return tuple(flat)

    def _checked_leaf(
        self, leaf: Any, shape: tuple[int, ...], dtype: Any, label: str, position: int, index: int, suffix: str
    ) -> Any:
        def where() -> str:
            return label + (self._path(position, index) + suffix)

        if not (arrays.is_array(leaf) or isinstance(leaf, (float, int))) or arrays.dtype_kind(leaf) not in "fi":
            raise ValueError(
                f"activity.{self.op_name}: {where()} is {describe_type(leaf)}; it must be a float array "
                f"of shape {shape}."
            )
        if arrays.dtype_kind(leaf) != "f":
            what = f"has dtype {leaf.dtype}" if arrays.is_array(leaf) else f"is {describe_type(leaf)}"
            raise ValueError(
                f"activity.{self.op_name}: {where()} {what}; tangents are floating point: {float_advice(leaf)}."
            )
        if arrays.shape(leaf) != shape:
            raise ValueError(
                f"activity.{self.op_name}: {where()} has shape {arrays.shape(leaf)}, expected {shape} "
                f"(the shape of the Active value there)."
            )
        return self.backend.as_tangent(leaf, dtype)

    def _path(self, position: int, index: int) -> str:
        # Paths are only needed for messages, so they are computed from the spec when asked.
        dummy = unflatten(self.specs[position], list(range(self.specs[position].num_leaves)))
        return leaf_paths(dummy)[index]

_WARNED_NUMBERS: set[tuple[Any, ...]] = set()  # (file, line, structure, paths) told of a Python float beside arrays


def _holds_arrays(node: dict[Any, Any] | list[Any]) -> bool:
    """Whether a plain dict or list holds an array, directly or below."""
    children = node.values() if isinstance(node, dict) else node
    return any(arrays.is_array(leaf) for child in children for leaf in flatten(child)[0])


def _mask_change(expected: tuple[Any, ...] | None, actual: tuple[Any, ...] | None) -> str:
    def count(selection: tuple[Any, ...] | None) -> str:
        if selection is None:
            return "no where= (all of it differentiated)"
        leaves = sum(1 for s in selection if s is True)
        params = sum(len(s) for s in selection if isinstance(s, tuple))
        parts = [f"{leaves} leaf(s)"] * bool(leaves or not params) + [f"{params} module parameter(s)"] * bool(params)
        return f"a where= selecting {' and '.join(parts)}"

    return (
        f"prepared with {count(expected)}, called with {count(actual)}, which selects other leaves. The mask is "
        f"part of the prepared signature: call with raw values (they take the prepared mask) or prepare again."
    )


def _answer(where: Callable[[str, Any], Any], path: str, leaf: Any, label: str) -> bool:
    """``where(path, leaf)``, which must be a bool (a numpy bool too)."""
    answer = where(path, leaf)
    if not isinstance(answer, (bool, np.bool_)):
        raise TypeError(
            f"{label}: where({path!r}, ...) returned {type(answer).__name__} {short_repr(answer, 40)}; it must return "
            f"True (differentiate this leaf) or False (keep it constant)."
        )
    return bool(answer)


def _broadcast_mask(where: Any, tree: Any, value: Any, label: str) -> list[Any]:
    """One mark per leaf of ``tree`` from a pytree of bools with a prefix of its structure (a
    torch module's mark may be a dict of parameter names or submodule prefixes to bools)."""
    leaves, _ = flatten(tree)
    if arrays.is_torch_module(value) and isinstance(where, dict):
        return [where]  # a module is one leaf: its names are matched in `_module_mark`
    try:
        subtrees = flatten(where)[1].flatten_up_to(tree)
    except (ValueError, TypeError):
        raise TypeError(
            f"{label}: the mask does not have a prefix of the value's structure: "
            f"{structure_difference(tree, where, prefix=True) if flatten(where)[1].num_leaves else 'it is empty'}. "
            f"Give one bool per part (a dict of bools for a dict, ...), or a callable where(path, leaf)."
        ) from None
    marks: list[Any] = []
    for mark, sub in zip(flatten(where)[0], subtrees):
        marks.extend([mark] * len(flatten(sub)[0]))  # a mark covers every leaf below it
    if len(marks) != len(leaves):
        raise TypeError(f"{label}: the mask does not line up with the value's leaves; use a callable where(path, leaf).")
    return marks


def _module_mask(mark: Any, names: Sequence[str], module: Any, label: str) -> Any:
    """A torch module's dict mask with its nested dicts read as dotted names (``{"head": {"bias":
    False}}`` is ``{"head.bias": False}``), checked: a key that names no parameter of the module
    and no submodule holding one (a misspelt ``"wieght"``) is a TypeError naming it, with the
    closest name. A bool mark is returned as is."""
    if not isinstance(mark, dict):
        return mark
    dotted: dict[str, Any] = {}
    pending = [("", mark)]
    while pending:
        prefix, part = pending.pop()
        for key, value in part.items():
            if isinstance(value, dict):
                pending.append((f"{prefix}{key}.", value))
            else:
                dotted[f"{prefix}{key}"] = value
    # every name a key may give: the parameters (frozen and tied ones too) and the submodules holding them
    try:
        every = module.named_parameters(remove_duplicate=False)
    except TypeError:  # an override without the keyword (torchrl's LossModule): its own names
        every = module.named_parameters()
    known = set(names) | {name for name, _ in every}
    known |= {name.rsplit(".", depth)[0] for name in list(known) for depth in range(1, name.count(".") + 1)}
    for key in dotted:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(
                f"{label}: the mask key {key!r} names no parameter or submodule of the {type(module).__name__}{hint}. "
                f"Its parameters are {list(names)[:6]}{' ...' if len(names) > 6 else ''}: key the mask by them, "
                f"or by a prefix (a submodule such as 'head'), or pass a callable where(path, leaf)."
            )
    return dotted


def _module_mark(mark: Any, name: str, label: str) -> bool:
    """A torch module parameter's mark: a bool for the whole module, or the value of the
    longest key of a dict that is the parameter's name or a prefix of it ("head" for "head.weight")."""
    if not isinstance(mark, dict):
        return bool(mark)
    keys = [key for key in mark if name == key or name.startswith(str(key) + ".")]
    if not keys:
        raise TypeError(
            f"{label}: the mask {sorted(mark)} says nothing about the parameter {name!r}. Give a bool for every "
            f"parameter or a prefix of its name (a submodule such as 'head'), or a callable where(path, leaf)."
        )
    return bool(mark[max(keys, key=len)])


def _static_number_hint(expected: tuple[Any, ...], actual: tuple[Any, ...]) -> str:
    """For a Python number that changed between prepared calls (a step counter such as
    ``TrainState.step``): how to pass one that changes without preparing again."""
    numbers = [meta[1] for meta in (expected, actual) if meta[0] == "static" and is_python_number(meta[1])]
    if len(numbers) < 2 or any(isinstance(number, bool) for number in numbers):
        return ""
    return (
        " A Python number is compiled in as a static value; make it an array (jnp.asarray, "
        "torch.tensor) to pass a new one without preparing again."
    )


def _data_note(adapter: Any, split: Any) -> str | None:
    """What a convention says of the data its ``split`` left out of an Active argument with
    nothing to differentiate (an NNX module's variables of the user's own types), or None
    (another convention, or none: ``split`` is then None)."""
    return adapter.data_note(split[2]) if hasattr(adapter, "data_note") else None


def _static_identity_hint(expected: tuple[Any, ...], actual: tuple[Any, ...]) -> str:
    """For an object without ``==`` of its own (a fast tokenizer's ``Encoding`` in a
    ``BatchEncoding``): a new one never equals the prepared one, whatever it holds."""
    if not (expected[0] == actual[0] == "static" and type(expected[1]) is type(actual[1])):
        return ""
    if type(actual[1]).__name__ in ("Jaxpr", "ClosedJaxpr") and type(actual[1]).__module__.startswith("jax"):
        # eqx.filter_closure_convert keeps the traced function as a Jaxpr leaf: a new
        # lineax.FunctionLinearOperator (or Equinox closure) traces a new one, even from the
        # same code. Equinox's jit recompiles there too; its advice is to build it inside.
        return (
            " A Jaxpr (what eqx.filter_closure_convert keeps of a function: a lineax.FunctionLinearOperator, "
            "an Equinox closure) is made anew for each new object, even from the same code, and compares by "
            "identity: build that object inside f from the arrays it closes over, passed as Constant (or "
            "Active), or pass the same object to every call."
        )
    if getattr(type(actual[1]), "__eq__") is not getattr(object, "__eq__"):
        return ""
    return (
        f" An object of type {type(actual[1]).__name__} compares by identity, so a new one never matches the prepared one: "
        f"pass only the arrays f needs (for a tokenizer's BatchEncoding, its .data dict)."
    )


def _complex_parameter(leaf: Any, index: int, trainable: int, in_tree: bool) -> bool:
    """Whether an Active argument's leaf is complex where a real one would be differentiated
    (see `_differentiable`): complex differentiation is not supported, so it is refused."""
    return arrays.dtype_kind(leaf) == "c" and _parameter_place(leaf, index, trainable, in_tree)


def _adapted_split(value: Any) -> tuple[Any, Any]:
    """The model library's convention that splits ``value`` (`adapter_for`) and its split, or (None, None)."""
    adapter = adapter_for(value)
    return adapter, None if adapter is None else adapter.split(value)


def _paths_in_order(value: Any, leaves: list[Any], adapted: bool) -> list[str]:
    """The paths of ``leaves``, an argument's leaves in the order the problem keeps them, as
    messages print them. A model library's split (an NNX module's parameters, then its other
    variables) orders them otherwise than ``value`` flattens: each is named by where the same
    array sits in the user's own object."""
    paths = leaf_paths(value)
    if not adapted:
        return paths
    own: dict[int, str] = {}
    for leaf, path in zip(flatten(value)[0], paths):
        own.setdefault(id(leaf), path)
    split = leaf_paths(leaves)
    return [own.get(id(leaf), split[index]) for index, leaf in enumerate(leaves)]


def _differentiable(leaf: Any, index: int, trainable: int, in_tree: bool) -> bool:
    """Whether an Active argument's leaf is differentiated (unless its ``where=`` leaves it out):
    floating, in the part a model library calls parameters (the first ``trainable`` leaves), and
    not a Python number inside a pytree (a static hyper-parameter, see `_conventions`). The
    signature a prepared call is checked against and the one it is looked up by both use it,
    so a changed hyper-parameter is a new signature, never the prepared value reused."""
    return arrays.dtype_kind(leaf) == "f" and _parameter_place(leaf, index, trainable, in_tree)


def _parameter_place(leaf: Any, index: int, trainable: int, in_tree: bool) -> bool:
    return index < trainable and not (in_tree and is_python_number(leaf))


def _same_meta(expected: tuple[Any, ...], actual: tuple[Any, ...]) -> bool:
    if expected[0] == "static" and actual[0] == "static":
        # The same object always matches itself, so an object changed in place is not seen
        # (see docs/preparation.md).
        return same_static_value(expected[1], actual[1])
    if _any_device(expected):
        return actual[0] == "torch" and expected[1:3] == actual[1:3]
    if expected[0] == "module" and actual[0] == "module" and expected[:2] == actual[:2]:
        # a module prepared on the meta device: its tensors fix shapes and dtypes, not devices
        return len(expected[2]) == len(actual[2]) and all(map(_same_layout_entry, expected[2], actual[2]))
    return expected == actual


def _same_layout_entry(expected: object, actual: object) -> bool:
    if isinstance(expected, tuple) and isinstance(actual, tuple) and len(expected) == len(actual) >= 4:
        if getattr(expected[3], "type", None) == "meta":
            return expected[:3] == actual[:3] and expected[4:] == actual[4:]
    return expected == actual


def wheres_of(args: Sequence[Any], prepared_wheres: Sequence[Any]) -> tuple[Any, ...]:
    """The Actives' ``where`` of a prepared call's arguments; raw values take the prepared ones."""
    return tuple(
        getattr(arg, "where", None) if isinstance(arg, Annotation) else prepared
        for arg, prepared in zip(args, prepared_wheres)
    )


def kinds_of(args: Sequence[Any], prepared_kinds: Sequence[str]) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    """Kinds and values of a prepared call's arguments; raw values take the prepared kinds."""
    kinds, values = [], []
    for arg, prepared in zip(args, prepared_kinds):
        if isinstance(arg, (Active, Constant, Cache)):
            kinds.append(arg.kind)
            values.append(arg.value)
        else:
            kinds.append(prepared)
            values.append(arg)
    return tuple(kinds), tuple(values)


__all__ = ["Problem", "Traced", "Arguments", "parse_arguments", "parse_call", "kinds_of", "wheres_of", "partition", "combine", "array_meta", "a"]

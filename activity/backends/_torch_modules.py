"""Module views: how ``f`` gets a torch module whose parameters are the differentiated tensors.

A *view* is a structural copy of a module: each of its submodules is copied,
sharing the original's ``__dict__`` entries (flags, hooks, config) but with its
own ``__dict__`` and its own parameter, buffer and submodule slots. So the
user's module, its buffers (BatchNorm statistics), attributes, flags and
``.grad`` never change, and a parameter shared by two arguments is
differentiated only where it is Active. A frozen parameter is held as a
copy-on-write copy (`frozen_copy`): a library that writes it inside the forward
(peft's merge and unmerge) writes the copy, never the user's weight.

The view must behave like the module *as it is called*, so what a module's
``__dict__`` holds of the tree is redirected to the view: bound methods and
``functools.partial`` objects that refer to a module of the tree (an instance
level ``forward``, accelerate's hooks); functions whose closure does (a copy
with new cells: torchmetrics' wrapped ``update``); plain containers (lists,
tuples, namedtuples, sets, dicts, dataclasses, namespaces, callable objects,
any other object with a ``__dict__``, weak references, torch pytree nodes such
as a ``TensorDict``) of its submodules, parameters and buffers
(``self.extra = [self.lin.weight]``: the
view's tensor, the tape leaf of a differentiated one); the user's hooks that
hold the model (a callable object, a partial, a closure: the view gets its own
copy of that hook dict); and compilation (``torch.compile(m)``'s wrapper and
``m.compile()``), which is bypassed: the view runs the module's own eager code,
the same computation. A function (an attribute or a hook) that reaches the
module, or one of its trainable parameters, through a global name cannot be
redirected and is refused before ``f`` runs.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import operator
import sys
import types
import warnings
import weakref
from typing import Any, Callable, Sequence

import attrs

from .._errors import UnsupportedError, caller_stacklevel
from .._tree import closure_values, global_values
from ._torch_internals import lazy_clone
from ._torch_keras import KERAS_WRAPPERS, check_built, keras_layer_type
from ._torch_lookups import holds_lookups

# Slots every module has; they are rebuilt for a view or hold hooks called with the view itself.
_SLOTS = frozenset(("_parameters", "_buffers", "_modules"))
_RNN_WEIGHTS = frozenset(("_flat_weights", "_flat_weight_refs"))  # an RNN's lists of (references to) its weights


class _Dropped:
    pass


_GONE = weakref.ref(_Dropped())  # a weak reference whose object is already gone


def _optimized_module_type() -> type | None:
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # torch.compile imports it
    return None if eval_frame is None else getattr(eval_frame, "OptimizedModule", None)


@attrs.frozen(eq=False)
class ModuleDescription:
    """What one walk over a module found (see `describe_module`).

    It holds its module weakly: descriptions are kept between calls (`described`), and
    a description must not keep a model the user has dropped alive.
    """

    module_ref: Any  # weakref.ref to the module
    names: list[str]  # trainable parameters, named like named_parameters(), shared ones once
    params: list[Any]
    layout: tuple[Any, ...]  # types, parameter and buffer layouts: what a prepared operator checks
    has_buffers: bool
    has_inference: bool = False  # a tensor made under torch.inference_mode (cloned in a view)
    has_lookups: bool = False  # an embedding lookup with a padding index (`_torch_lookups`)
    # For `still_describes`: the parameter, buffer and submodule dicts of every visited
    # module, with the objects each held (empty ones apart), each tensor's metadata, and
    # each module's __dict__: its size (a new instance attribute such as `forward`) and the
    # ids of the values a view redirects (an instance `forward` replaced by another).
    # Kept flat, so that the check is a few C-level passes (`still_describes`).
    slot_dicts: tuple[Any, ...] = ()  # then each submodule's __dict__ (its size: a new instance attribute)
    slot_sizes: tuple[Any, ...] = ()
    root_size: int = 0  # len(module.__dict__), which may refer to the module itself: not held
    filled_dicts: tuple[Any, ...] = ()  # the slot dicts that hold something
    slot_objects: tuple[Any, ...] = ()  # what they hold, in order
    tensors: tuple[Any, ...] = ()
    tensor_metas: tuple[Any, ...] = ()  # _TENSOR_META of each tensor
    tensor_guard: Any = None  # `tensor_guard` of the tensors: the same answer, in one C++ call
    module_refs: tuple[Any, ...] = ()  # weakref.ref to every visited module
    watched: tuple[Any, ...] = ()  # (index into module_refs, ((key, id(value)), ...)) where a view redirects keys
    # id(module) -> the __dict__ keys of that module a view redirects (see the module docstring).
    redirected: dict[Any, Any] = attrs.field(factory=dict)
    # id(module) -> the __dict__ keys holding a plain list or dict a view copies (`_copied_keys`).
    copied: dict[Any, Any] = attrs.field(factory=dict)
    plans: dict[Any, Any] = attrs.field(factory=dict)  # Active (False) / Constant (True) -> its _ViewPlan, made once
    narrowed: dict[tuple[str, ...], Any] = attrs.field(factory=dict)  # selected names -> the description `selecting` them
    reused: list[Any] = attrs.field(factory=list)  # idle `ReusedView`s of this description (see `lease_view`)
    reused_constant: list[Any] = attrs.field(factory=list)  # ... and of it as a Constant module

    @property
    def module(self) -> Any:
        return self.module_ref()

    def selecting(self, names: tuple[str, ...]) -> "ModuleDescription":
        """This description with only ``names`` differentiated (``Active(module, where=...)``):
        the other trainable parameters are held as a Constant module's are. Made once per
        selection; the user's ``requires_grad`` flags are never changed."""
        if tuple(names) == tuple(self.names):
            return self
        found = self.narrowed.get(tuple(names))
        if found is None:
            keep = set(names)
            pairs = [(name, p) for name, p in zip(self.names, self.params) if name in keep]
            found = attrs.evolve(
                self, names=[n for n, _ in pairs], params=[p for _, p in pairs], plans={}, narrowed={}, reused=[], reused_constant=[]
            )
            self.narrowed[tuple(names)] = found
        return found

    def still_describes(self, module: Any) -> bool:
        """Whether ``module`` is the module described, unchanged: the same objects in every
        submodule, parameter and buffer slot, each tensor with the same shape, dtype,
        device and ``requires_grad``, no new instance attribute, the same values where a
        view redirects one. Cheaper than a new walk (no names, no layout): it runs on
        every prepared call, so each part is one pass of C-level iteration."""
        if module is not self.module_ref() or len(module.__dict__) != self.root_size:
            return False
        if tuple(map(len, self.slot_dicts)) != self.slot_sizes:  # every submodule's __dict__ among them
            return False
        # With every size unchanged, the values in order are the same objects or a slot changed.
        if not all(map(operator.is_, itertools.chain.from_iterable(map(dict.values, self.filled_dicts)), self.slot_objects)):
            return False
        guard = self.tensor_guard
        if (guard is None or not guard.check(*self.tensors)) and tuple(map(_TENSOR_META, self.tensors)) != self.tensor_metas:
            return False
        for index, keys in self.watched:
            state = self.module_refs[index]().__dict__
            if any(id(state.get(key)) != ident for key, ident in keys):
                return False
        return True


# What a description checks of each tensor it holds; changed in place by `p.requires_grad_()`,
# `p.data = ...` or `p.resize_(...)`.
_TENSOR_META = operator.attrgetter("requires_grad", "dtype", "shape", "device")


def tensor_guard(tensors: list[Any]) -> Any:
    """A check of ``tensors`` that says yes only where each still has the type, dtype, device,
    shape, strides and ``requires_grad`` it has now: the guard that ``torch.compile`` runs on
    every call of a compiled function, one C++ pass for all tensors (4x faster than reading
    `_TENSOR_META` of 6 parameters). A no is not final (the guard also compares dispatch
    state such as autocast's, which the metadata does not depend on): `still_describes` then
    reads the metadata. None where this torch has no such guard, or it does not take these tensors."""
    try:
        # Typed by its stub for dynamo's own use; it takes one list of sizes (strides) per tensor.
        tensor_guards: Any = sys.modules["torch"]._C._dynamo.guards.TensorGuards
        guard = tensor_guards(
            *tensors,
            dynamic_dims_sizes=[list(t.shape) for t in tensors],
            dynamic_dims_strides=[list(t.stride()) for t in tensors],
        )
        return guard if guard.check(*tensors) else None
    except Exception:  # noqa: BLE001 - a private API: without it, the metadata is read as before
        return None


def describe_module(module: Any) -> ModuleDescription:
    """Walk ``module`` once: its trainable parameters and the layout a prepared operator checks."""
    names: list[str] = []
    params: list[Any] = []
    layout: list[Any] = []
    slot_dicts: list[dict[Any, Any]] = []
    tensors: list[Any] = []
    modules: list[Any] = []
    seen: set[int] = set()

    def visit(m: Any, prefix: str) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        if isinstance(m, script_module):
            raise UnsupportedError(
                f"activity: {_where(prefix, m)} is a TorchScript module (made by torch.jit.script, torch.jit.trace "
                f"or torch.jit.load). Its parameters and buffers live in the compiled module, where activity "
                f"cannot put the tensors it differentiates nor copies of the buffers. Pass the eager module it "
                f"was made from (script or trace it afterwards), or use torch.compile, which activity follows."
            )
        if keras_layer is not None and isinstance(m, keras_layer):
            check_built(m, _where(prefix, m))
        modules.append(m)
        layout.append(type(m))
        slot_dicts.extend((m._parameters, m._buffers, m._modules))
        for key, p in m._parameters.items():
            if p is None or id(p) in seen:
                continue
            if is_lazy(p):
                raise UnsupportedError(
                    f"activity: the parameter {prefix + key} is not initialized yet (a lazy module such as "
                    f"nn.LazyLinear: its shape is known after its first forward pass). Run the module once on "
                    f"an input of the right shape before differentiating it."
                )
            seen.add(id(p))
            layout.append((prefix + key, p.shape, p.dtype, p.device, p.requires_grad))
            tensors.append(p)
            if p.requires_grad:
                names.append(prefix + key)
                params.append(p)
        for key, b in m._buffers.items():
            if b is not None:
                layout.append((prefix + key, b.shape, b.dtype, b.device))
                tensors.append(b)
        for key, child in m._modules.items():
            if child is not None:
                visit(child, prefix + key + ".")

    torch = sys.modules["torch"]
    script_module, is_lazy = torch.jit.ScriptModule, torch.nn.parameter.is_lazy
    keras_layer = keras_layer_type()
    visit(module, "")
    has_buffers = any(b is not None for slots in slot_dicts[1::3] for b in slots.values())
    names_of = _module_names(module)
    redirected = {}
    copied = {}
    optimized = _optimized_module_type()
    tree = _Tree(frozenset(seen.union(map(id, tensors))), frozenset(map(id, params)))
    hooked = _hook_held(modules)
    for m in modules:
        if optimized is not None and isinstance(m, optimized):
            continue  # a view replaces it by its `_orig_mod` (see `bound_view`)
        keys = _redirected_keys(m, tree, names_of)
        if keys:
            redirected[id(m)] = keys
        plain = _copied_keys(m, keys, hooked)
        if plain:
            copied[id(m)] = plain
    return ModuleDescription(
        weakref.ref(module),
        names,
        params,
        tuple(layout),
        has_buffers,
        any(t.is_inference() for t in tensors),
        any(map(holds_lookups, modules)),
        # The slot dicts hold the submodules alive anyway; the root's __dict__ may refer to the root.
        slot_dicts=(*slot_dicts, *(m.__dict__ for m in modules[1:])),
        slot_sizes=(*map(len, slot_dicts), *(len(m.__dict__) for m in modules[1:])),
        root_size=len(module.__dict__),
        filled_dicts=tuple(slots for slots in slot_dicts if slots),
        slot_objects=tuple(itertools.chain.from_iterable(map(dict.values, slot_dicts))),
        tensors=tuple(tensors),
        tensor_metas=tuple(map(_TENSOR_META, tensors)),
        tensor_guard=tensor_guard(tensors) if tensors else None,
        module_refs=tuple(map(weakref.ref, modules)),
        watched=tuple(
            (index, tuple((key, id(m.__dict__[key])) for key in redirected[id(m)]))
            for index, m in enumerate(modules)
            if id(m) in redirected
        ),
        redirected=redirected,
        copied=copied,
    )


def _where(prefix: str, module: Any) -> str:
    return f"the submodule {prefix[:-1]}" if prefix else f"the module ({type(module).__name__})"


_RECENT: dict[int, ModuleDescription] = {}  # id(module) -> its latest description, while it lives


def described(module: Any) -> ModuleDescription:
    """`describe_module`, reusing the module's last description while it still describes it
    (an unprepared call on the same model, call after call, walks it once)."""
    previous = _RECENT.get(id(module))
    if previous is not None and previous.still_describes(module):
        return previous
    description = describe_module(module)
    _RECENT[id(module)] = description
    if previous is None:
        weakref.finalize(module, _RECENT.pop, id(module), None)
    return description


def _module_names(module: Any) -> dict[int, str]:
    return {id(m): name or type(m).__name__ for name, m in module.named_modules(remove_duplicate=True)}


@attrs.frozen
class _Tree:
    """The ids of what a described module holds, for `_refers_to_tree`."""

    members: frozenset[int]  # its modules, parameters and buffers
    trainable: frozenset[int]  # its trainable parameters
    # id -> whether that attribute value refers to the tree, for those many modules share (a model's config)
    checked: dict[int, bool] = attrs.field(factory=dict)


# What a view holds as None where its original holds a value: compilation (the view runs the
# module's eager code), and a gpytorch ExactGP's prediction cache, built in eval mode by a
# forward of the user's and holding the user's kernel and likelihood, which would compute the
# predictive covariance from the user's parameters instead of the tape's leaves (the derivative
# through it lost). Without it the view's forward builds a cache of its own from its own
# parameters, one that gives the values and derivatives the user's forward gives (a cache gone
# stale, the parameters changed in eval mode without ``model.train()``, is not followed: a
# fresh forward's).
_DROPPED = frozenset(("_compiled_call_impl", "prediction_strategy"))


def _is_exact_gp(m: Any) -> bool:
    models = sys.modules.get("gpytorch.models")
    return models is not None and isinstance(m, models.ExactGP)


def replaced_parameters(pairs: list[tuple[Any, Any]]) -> dict[int, Any]:
    """``id(user's parameter) -> the view's tensor in its place``, over ``(module, view)`` pairs
    (a view's parameters follow its module's order, tied ones once, as ``parameters()`` lists them)."""
    replaced: dict[int, Any] = {}
    for module, view in pairs:
        if view is not module:
            for own, viewed in zip(module.parameters(), view.parameters()):
                if viewed is not own:
                    replaced[id(own)] = viewed
    return replaced


def _copied_keys(m: Any, redirected: tuple[str, ...], hooked: set[int]) -> tuple[str, ...]:
    """The keys of ``m.__dict__`` holding a plain list or dict (not torch's own slots and hook
    dicts, nor one `_redirected_keys` rebuilds) that a view holds a shallow copy of: what f
    adds to it must not reach the user's module, as an attribute f sets does not. Opacus's
    hooks append each forward pass's inputs to ``module.activations`` and its backward hook
    pops them: a call that ran f's forward more often than its backward (f calling the model
    twice, a pushforward) left entries in the user's list, and the user's next training step
    then kept a stale ``max_batch_len`` (its per-sample gradients scaled by another batch's size).
    A list a hook of the tree holds in its closure (``hooked``: the hook appends to it, the
    forward reads it) stays shared, so that what the hook appends is what the module reads."""
    keras_layer = keras_layer_type()
    if keras_layer is not None and isinstance(m, keras_layer):
        return ()  # (its variables' tracker holds its lists themselves)
    return tuple(
        key
        for key, value in m.__dict__.items()
        if (type(value) is list or type(value) is dict) and key not in _SLOTS and key not in redirected
        and key not in _RNN_WEIGHTS and id(value) not in hooked
    )


def _hook_held(modules: list[Any]) -> set[int]:
    """The ids of what the hooks of ``modules`` hold in their closures (and a partial's arguments)."""
    held: set[int] = set()
    for m in modules:
        state = m.__dict__
        for name in _HOOK_DICTS:
            for hook in (state.get(name) or {}).values():
                function = hook.func if isinstance(hook, functools.partial) else hook
                parts = [*closure_values(function)] if isinstance(function, types.FunctionType) else []
                if isinstance(hook, functools.partial):
                    parts += [*hook.args, *hook.keywords.values()]
                held.update(map(id, parts))
    return held


def _redirected_keys(m: Any, tree: _Tree, names_of: dict[int, str]) -> tuple[str, ...]:
    """The keys of ``m.__dict__`` whose values refer to a module or tensor of the tree (checked here, once)."""
    torch_nn = sys.modules["torch"].nn
    keras_layer = keras_layer_type()
    wrappers = KERAS_WRAPPERS if keras_layer is not None and isinstance(m, keras_layer) else ()
    keys = []
    for key, value in m.__dict__.items():
        if key in wrappers:
            continue
        if key == "prediction_strategy" and _is_exact_gp(m):
            keys.append(key)  # even while None: a later forward of the user's fills it (see `_DROPPED`)
            continue
        if key in _SLOTS or isinstance(value, (bool, int, float, str, type(None), torch_nn.Parameter)):
            continue
        if "hook" in key and not value:
            continue  # (hooks are called with the view itself; those that hold the tree otherwise are redirected)
        if key in _RNN_WEIGHTS:
            continue  # a view rebuilds them (`_views`)
        if key == "_compiled_call_impl" and value is not None:
            keys.append(key)
        elif _refers_to_tree(value, tree, f"{names_of.get(id(m), type(m).__name__)}.{key}", depth=0):
            keys.append(key)
    return tuple(keys)


def _refers_to_tree(value: Any, tree: _Tree, where: str, depth: int) -> bool:
    """Whether ``value`` refers to a module, parameter or buffer of the tree in a way a view can
    redirect; raises for a function whose closure holds a module or trainable parameter (it would
    run the user's module, or differentiate nothing through the parameter)."""
    if depth > 3:
        return False
    torch = sys.modules["torch"]
    if isinstance(value, (torch.nn.Module, torch.Tensor)):
        return id(value) in tree.members
    if isinstance(value, types.MethodType):
        return id(value.__self__) in tree.members or _refers_to_tree(value.__func__, tree, where, depth + 1)
    if isinstance(value, functools.partial):
        return any([_refers_to_tree(part, tree, where, depth + 1) for part in _partial_parts(value)])
    contents = _contents(value)
    if contents is not None:
        known = tree.checked.get(id(value)) if depth == 0 else None  # (deeper, the depth limit cuts differently)
        if known is not None:
            return known
        found = any([_refers_to_tree(item, tree, where, depth + 1) for item in contents])
        if depth == 0:
            tree.checked[id(value)] = found
        if found and isinstance(value, tuple) and type(value) is not tuple and not hasattr(value, "_make"):
            raise UnsupportedError(
                f"activity: the attribute {where} is a {type(value).__name__} (a tuple subclass) holding a module "
                f"or tensor of the argument. activity runs a view of the module and cannot rebuild that "
                f"{type(value).__name__} around the view's parts. Hold them in a list, tuple, dict or namedtuple."
            )
        return found
    if isinstance(value, types.FunctionType):
        # Its closure may hold the module (torchmetrics wraps each Metric's `update` and `compute` in
        # a closure over the metric; `m.forward = lambda x: original(x) * 2`): the view gets a copy
        # of the function whose cells hold the view's parts (`_redirect`). A global name cannot be
        # redirected so: the function would run the user's module, or differentiate nothing
        # through a parameter it reads.
        found = any([_refers_to_tree(cell, tree, where, depth + 1) for cell in closure_values(value)])
        for content in global_values(value):
            # (a buffer it reads is the user's, unchanged: the same values as the view's copy)
            held = id(content) in tree.trainable or (
                not isinstance(content, torch.Tensor) and _refers_to_tree(content, tree, where, depth + 1)
            )
            if held:
                raise UnsupportedError(
                    f"activity: the attribute {where} is a function that reaches a module or a parameter of "
                    f"the argument through a global name. activity runs a view of the module (the "
                    f"differentiated parameters, copies of the buffers), and that function would use the "
                    f"original instead. Make it a method, or pass the module to it (functools.partial("
                    f"function, module), or a closure), or remove it before differentiating."
                )
        return found
    return False


def _redirect(value: Any, views: dict[int, Any]) -> Any:
    """``value`` with every module and tensor of the tree replaced by the view's (see `_refers_to_tree`)."""
    torch = sys.modules["torch"]
    if isinstance(value, (torch.nn.Module, torch.Tensor)):
        return views.get(id(value), value)
    if isinstance(value, types.MethodType):
        return types.MethodType(_redirect(value.__func__, views), _redirect(value.__self__, views))
    if isinstance(value, functools.partial):
        new = functools.partial(
            _redirect(value.func, views),
            *[_redirect(a, views) for a in value.args],
            **{k: _redirect(v, views) for k, v in value.keywords.items()},
        )
        for key, attribute in getattr(value, "__dict__", {}).items():  # __wrapped__ etc. (update_wrapper)
            setattr(new, key, _redirect(attribute, views))
        return new
    if isinstance(value, types.FunctionType):
        return _redirected_function(value, views)
    kind = type(value)
    if kind is list or kind is tuple or kind is set or kind is frozenset:
        return kind(_redirect(item, views) for item in value)
    if kind is dict:
        return {k: _redirect(v, views) for k, v in value.items()}
    if isinstance(value, tuple):  # a namedtuple (`_refers_to_tree` refused the others)
        return kind._make(_redirect(item, views) for item in value)
    if isinstance(value, weakref.ReferenceType):
        target = value()
        view = views.get(id(target), target)
        return value if view is target else weakref.ref(view)
    if isinstance(value, (list, dict)) or _is_record(value):  # subclasses (OrderedDict), dataclasses, namespaces
        if not hasattr(value, "__dict__") and not isinstance(value, (list, dict)) and not _reaches(value, views, depth=0):
            return value  # a slotted object beside the tree's parts: not copied (it may not know how)
        rebuilt: Any = copy.copy(value)
        if isinstance(value, list):
            rebuilt[:] = [_redirect(item, views) for item in value]
        elif isinstance(value, dict):
            rebuilt.update((k, _redirect(v, views)) for k, v in value.items())
        else:
            if hasattr(value, "__dict__"):
                rebuilt.__dict__.update((k, _redirect(v, views)) for k, v in vars(value).items())
            for name, item in _slot_items(value):  # (object.__setattr__: a frozen slotted dataclass refuses setattr)
                object.__setattr__(rebuilt, name, _redirect(item, views))
        return rebuilt
    if _is_pytree_node(value):  # a tensordict TensorDict: rebuilt by its library around the view's parts
        pytree = sys.modules["torch.utils._pytree"]
        leaves, spec = pytree.tree_flatten(value)
        return pytree.tree_unflatten([_redirect(leaf, views) for leaf in leaves], spec)
    return value


def _redirected_function(function: types.FunctionType, views: dict[int, Any]) -> Any:
    """A copy of ``function`` whose closure cells that reach the tree (`_reaches`) hold the
    view's parts; the other cells are the function's own, so state it keeps in them (a
    ``nonlocal`` counter, a list it appends to) is shared with the original as before."""
    closure = function.__closure__ or ()
    cells = tuple(
        types.CellType(_redirect(content, views)) if _reaches(content := _cell_or_none(cell), views, depth=0) else cell
        for cell in closure
    )
    if all(new is old for new, old in zip(cells, closure)):
        return function
    new = types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__, cells)
    new.__kwdefaults__ = function.__kwdefaults__
    new.__qualname__, new.__module__, new.__doc__ = function.__qualname__, function.__module__, function.__doc__
    new.__annotations__ = function.__annotations__
    for key, attribute in function.__dict__.items():  # __wrapped__ (functools.wraps) etc.
        setattr(new, key, _redirect(attribute, views))
    return new


def _cell_or_none(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not filled yet
        return None


def _reaches(value: Any, views: dict[int, Any], depth: int) -> bool:
    """Whether ``value`` holds, where `_redirect` replaces them, a module or tensor ``views``
    has a view of: `_refers_to_tree` at call time, for a closure's cells."""
    if depth > 3:
        return False
    torch = sys.modules["torch"]
    if isinstance(value, (torch.nn.Module, torch.Tensor)):
        return id(value) in views
    if isinstance(value, types.MethodType):
        return _reaches(value.__self__, views, depth + 1) or _reaches(value.__func__, views, depth + 1)
    if isinstance(value, functools.partial):
        return any(_reaches(part, views, depth + 1) for part in _partial_parts(value))
    if isinstance(value, types.FunctionType):
        return any(_reaches(content, views, depth + 1) for content in closure_values(value))
    return any(_reaches(item, views, depth + 1) for item in _contents(value) or ())


def _partial_parts(value: functools.partial[Any]) -> tuple[Any, ...]:
    """What a ``functools.partial`` holds: its function, arguments, keywords and attributes."""
    return (value.func, *value.args, *value.keywords.values(), *getattr(value, "__dict__", {}).values())


def _is_record(value: Any) -> bool:
    """An object whose attributes a view can rebuild in a copy: a dataclass instance, a
    ``types.SimpleNamespace``, a callable object (a hook such as ``Scaler(model)``), or any other
    instance with a ``__dict__`` (a helper such as ``self.helper = Helper(self.encoder)``, whose
    ``helper.encoder(x)`` in the forward would otherwise run the user's submodule, not the view's:
    the derivative through it lost)."""
    if isinstance(value, types.SimpleNamespace):
        return True
    if isinstance(value, (type, types.FunctionType, types.ModuleType)):
        return False
    if not hasattr(value, "__dict__"):
        # An instance of a class with ``__slots__`` (``dataclass(slots=True)``): its attributes
        # live in the slots; a helper so held ran the user's submodule, the derivative through it lost.
        return bool(_slot_names(type(value)))
    # a torch pytree node (a TensorDict) is taken apart by its own library, not by its __dict__
    return dataclasses.is_dataclass(value) or callable(value) or not _is_pytree_node(value)


def _slot_names(kind: type) -> tuple[str, ...]:
    """The attribute names the ``__slots__`` of ``kind`` and its bases declare (private ones
    mangled as Python stores them), for the plain Python classes a view rebuilds."""
    names: list[str] = []
    for klass in kind.__mro__:
        declared = vars(klass).get("__slots__", ())
        for name in (declared,) if isinstance(declared, str) else declared:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{klass.__name__.lstrip('_')}{name}"
            if name not in names:
                names.append(name)
    return tuple(names)


def _slot_items(value: Any) -> list[tuple[str, Any]]:
    """``(name, value)`` of the filled ``__slots__`` of ``value`` (an unset slot has no value)."""
    missing = object()
    items = ((name, getattr(value, name, missing)) for name in _slot_names(type(value)))
    return [(name, item) for name, item in items if item is not missing]


def _contents(value: Any) -> Any:
    """The values a plain container holds (lists, tuples, sets, dicts, objects' attributes, a
    weak reference's target, the leaves of a torch pytree node), which a view redirects
    (`_redirect`); None for anything else."""
    if isinstance(value, (list, tuple, set, frozenset)):
        return value
    if isinstance(value, dict):
        return value.values()
    if isinstance(value, weakref.ReferenceType):
        return (value(),)
    if _is_record(value):
        slotted = _slot_items(value)
        if not slotted:
            return vars(value).values()
        return [*getattr(value, "__dict__", {}).values(), *(item for _, item in slotted)]
    if _is_pytree_node(value):  # all its leaves at once: a TensorDict nests deeper than the depth limit
        return sys.modules["torch.utils._pytree"].tree_leaves(value)
    return None


def _is_pytree_node(value: Any) -> bool:
    """Whether ``value`` is a container registered with torch's pytree that the cases above do
    not take apart: a tensordict ``TensorDict`` (a ``TensorDictParams`` reads its parameters from
    one, not from its parameter slots; torchrl's losses keep their networks' parameters so),
    taken apart and rebuilt as ``torch.func`` does. Without it the view used the user's own
    parameters through the container, and that path was left out of the derivative, silently."""
    pytree = sys.modules.get("torch.utils._pytree")
    return pytree is not None and type(value) in pytree.SUPPORTED_NODES


@attrs.frozen
class _Copy:
    """One submodule a view copies, and where each of its slots comes from."""

    original_ref: Any  # weakref.ref: a kept plan must not keep the model alive
    params: tuple[Any, ...]  # (key, source): source -1 for None, else an index into the call's tensors
    buffers: tuple[Any, ...]
    children: tuple[Any, ...]  # (key, step): step -1 for None, else the index of the child's view
    rnn: bool  # RNNs cache their weights in `_flat_weights`
    attributed: tuple[Any, ...] = ()  # (key, source) of the parameters with Python attributes (`_attributes_of`)
    copied: tuple[str, ...] = ()  # the __dict__ keys whose plain list or dict the view copies (`_copied_keys`)


@attrs.frozen
class _ViewPlan:
    """How to build a view of a described module: what `bound_view` does on every call,
    worked out once per description (the walk, the sharing, which submodules stay)."""

    steps: tuple[Any, ...]  # one _Copy per submodule, children before parents
    sources: tuple[Any, ...]  # the tensors a call converts (buffers, parameters not replaced), each once
    n_params: int  # the replaced parameters come first in the call's tensors
    root: int
    redirects: tuple[Any, ...]  # (step, keys) to redirect after every view exists
    step_of: tuple[Any, ...]  # (id(module), step) for every module of the tree, torch.compile wrappers included
    tensor_of: tuple[Any, ...]  # (id(tensor), index into the call's tensors) for every parameter and buffer


def _plan(module: ModuleDescription, active: bool) -> _ViewPlan:
    optimized = _optimized_module_type()
    steps: list[Any] = []
    index_of: dict[int, int] = {}  # id(module) -> step
    tensor_index: dict[int, int] = {id(p): i for i, p in enumerate(module.params)} if active else {}
    sources: list[Any] = []

    def slot(t: Any) -> int:
        if t is None:
            return -1
        if id(t) not in tensor_index:
            tensor_index[id(t)] = len(module.params if active else ()) + len(sources)
            sources.append(t)
        return tensor_index[id(t)]

    def visit(m: Any) -> int:
        if id(m) in index_of:
            return index_of[id(m)]
        if optimized is not None and isinstance(m, optimized):
            index_of[id(m)] = found = visit(m._orig_mod)  # type: ignore[attr-defined]  # torch.compile(m): its eager code, through a view
            return found
        children = tuple((k, -1 if c is None else visit(c)) for k, c in m._modules.items())
        # Every submodule is copied, one without parameters or buffers too: what f sets on it (a
        # counter of calls, a torchmetrics Metric's update count and states) must reach the view,
        # never the user's module, and a function attribute redirected to the view (a Metric's
        # wrapped `update`) must find the view's module where the user's stands.
        steps.append(
            _Copy(
                weakref.ref(m),
                tuple((k, slot(p)) for k, p in m._parameters.items()),
                tuple((k, slot(b)) for k, b in m._buffers.items()),
                children,
                "_flat_weights_names" in m.__dict__,
                tuple((k, slot(p)) for k, p in m._parameters.items() if p is not None and p.__dict__),
                module.copied.get(id(m), ()),
            )
        )
        index_of[id(m)] = len(steps) - 1
        return len(steps) - 1

    root = visit(module.module)
    redirects = tuple(
        (i, module.redirected[id(step.original_ref())])
        for i, step in enumerate(steps)
        if id(step.original_ref()) in module.redirected
    )
    # Only the tensors a redirected value holds: a view redirects on every call.
    held: set[int] = set()
    for step_index, keys in redirects:
        original = steps[step_index].original_ref()
        for key in keys:
            _tensor_ids(original.__dict__[key], held, depth=0)
    return _ViewPlan(
        tuple(steps),
        tuple(sources),
        len(module.params) if active else 0,
        root,
        redirects,
        tuple(index_of.items()),
        tuple((t, index) for t, index in tensor_index.items() if t in held),
    )


def _tensor_ids(value: Any, found: set[int], depth: int) -> None:
    """Add to ``found`` the ids of the tensors ``value`` holds where `_redirect` reaches them."""
    if depth > 3:
        return
    if isinstance(value, sys.modules["torch"].Tensor):
        found.add(id(value))
    elif isinstance(value, types.MethodType):
        _tensor_ids(value.__func__, found, depth + 1)
    elif isinstance(value, functools.partial):
        for part in _partial_parts(value):
            _tensor_ids(part, found, depth + 1)
    elif isinstance(value, types.FunctionType):
        for content in closure_values(value):
            _tensor_ids(content, found, depth + 1)
    else:
        for item in _contents(value) or ():
            _tensor_ids(item, found, depth + 1)


def _plan_of(module: ModuleDescription, active: bool) -> _ViewPlan:
    plan = module.plans.get(not active)
    if plan is None:
        plan = module.plans[not active] = _plan(module, active)
    return plan


def bound_view(module: ModuleDescription, params: list[Any] | None, convert: Callable[[Any], Any]) -> Any:
    """A view of the described module whose trainable parameters are ``params``.

    ``params`` follow `describe_module`'s order (None: a Constant module, no
    parameter replaced). Every other parameter and buffer is ``convert``-ed (a
    clone for AD, a float64 copy for finite differences). Shared submodules and
    tied parameters stay shared in the view; the original is never written.
    """
    plan = _plan_of(module, params is not None)
    return _views(plan, [*(params or ()), *map(convert, plan.sources)])[plan.root]


def _views(
    plan: _ViewPlan, tensors: list[Any], copies: list[Any] | None = None, attributed: list[Any] | None = None
) -> list[Any]:
    """One view per step of ``plan`` over ``tensors``; ``copies`` collects, for each copied
    submodule, what `ReusedView.refresh` needs to re-point it: (weakref to the original, the
    view's ``__dict__``, the view's own slots); ``attributed`` the (view's tensor, parameter)
    pairs whose parameter carries attributes (`_attributes_of`)."""
    views: list[Any] = []
    plain: dict[int, Any] = {}
    for step in plan.steps:
        original = step.original_ref()
        state = original.__dict__.copy()
        if step.copied:
            _copy_plain(state, step.copied, plain)
        held = original._parameters
        parameters = {k: None if i < 0 else _parameter_slot(tensors[i], held.get(k)) for k, i in step.params}
        for k, i in step.attributed:
            parameters[k] = _attributes_of(parameters[k], held[k])
            if attributed is not None:
                attributed.append((parameters[k], held[k]))
        state["_parameters"] = parameters
        state["_buffers"] = {k: None if i < 0 else tensors[i] for k, i in step.buffers}
        state["_modules"] = {k: None if i < 0 else views[i] for k, i in step.children}
        if step.rnn:
            _flat_weights(state, original)
        new = object.__new__(type(original))
        object.__setattr__(new, "__dict__", state)  # nn.Module.__setattr__ is slow and would refuse tensors
        views.append(new)
        if copies is not None:
            own = (*_SLOTS, "_flat_weights", "_flat_weight_refs") if step.rnn else _SLOTS
            copies.append((step.original_ref, state, {key: state[key] for key in own if key in state}))
    if plan.redirects:  # after every view exists: a method may refer to a parent
        _redirect_all(plan, views, tensors)
    return views


def _flat_weights(state: dict[str, Any], original: Any) -> None:
    """An RNN view's lists of its weights (and references to them), from its parameter slots."""
    names, parameters = state["_flat_weights_names"], state["_parameters"]
    state["_flat_weights"] = flat = [parameters.get(w, state.get(w)) for w in names]
    if "_flat_weight_refs" in state:  # what the RNN's forward compares its weights with (else it rebuilds them)
        state["_flat_weight_refs"] = [
            weakref.ref(w) if w is not None
            # a parametrized weight (computed on access): "changed", so the forward computes it from the view
            else _GONE if isinstance(getattr(type(original), name, None), property)
            else None
            for name, w in zip(names, flat)
        ]


def _copy_plain(state: dict[str, Any], keys: tuple[str, ...], copies: dict[int, Any]) -> None:
    """A shallow copy of each plain list or dict at ``keys``; one copy per object over the whole
    view (``copies``), so that submodules sharing a list (each block appending to its parent's
    list of features) still share it in the view."""
    for key in keys:
        value = state.get(key)
        if type(value) is list or type(value) is dict:
            copied = copies.get(id(value))
            if copied is None:
                copied = copies[id(value)] = value.copy()
            state[key] = copied


def _attributes_of(tensor: Any, parameter: Any) -> Any:
    """``tensor`` (the view's, in place of ``parameter``) with a copy of the Python attributes
    ``parameter`` carries: opacus keeps a counter of forward passes (``p._forward_counter``) and
    the per-sample gradients (``p.grad_sample``, a tensor or a list of them) on each parameter, and its hooks, which f runs,
    read and write them on the parameters the view holds. A tape leaf without them made its
    hooks fail, and a parameter held as it is (a Constant module's, a frozen one) had them
    written on the user's own parameter: the view holds an alias of it then, the same storage
    and ``requires_grad``."""
    if tensor is parameter:
        tensor = _parameter_type()(parameter.detach(), requires_grad=parameter.requires_grad)
    state = tensor.__dict__
    state.clear()
    # (a list of them is copied: opacus appends each backward pass's per-sample gradients to it)
    state.update((k, copy.copy(v) if type(v) in _MUTABLE else v) for k, v in parameter.__dict__.items())
    return tensor


_MUTABLE = frozenset((list, dict, set))


def _same_attributes(mine: dict[str, Any], theirs: dict[str, Any]) -> bool:
    """The same keys, holding the same objects (by identity: pyro's parameters carry tensors)."""
    return len(mine) == len(theirs) and all(mine.get(key, _MUTABLE) is value for key, value in theirs.items())


def _all_same_attributes(tensors: tuple[Any, ...], parameters: tuple[Any, ...]) -> bool:
    """Whether each of ``tensors`` still carries what its parameter does, as far as one comparison
    in C tells (every parameter of a loaded Hugging Face model carries a flag, so this runs for
    each of them on every call): dicts compare their values by identity first, and equal
    immutable values are as good as the same. False where it cannot tell (a tensor or a list of
    them, compared element by element): the caller then compares by identity, one by one."""
    try:
        return list(map(_DICT_OF, tensors)) == list(map(_DICT_OF, parameters))
    except Exception:  # noqa: BLE001 - a value whose == is not a bool (a tensor's)
        return False


_DICT_OF = operator.attrgetter("__dict__")
_GRAD_OF = operator.attrgetter("grad")


def grads_left(tensors: Sequence[Any]) -> bool:
    """Whether any of ``tensors`` (a view's tape leaves and aliases) has a ``.grad``: a backward
    pass f ran of its own put it there. (One pass in C: it runs on every call.)"""
    return list(map(_GRAD_OF, tensors)).count(None) != len(tensors)


def clear_grads(tensors: Sequence[Any]) -> None:
    """Drop the ``.grad`` a backward pass of f's own left on ``tensors``, which are ours."""
    if grads_left(tensors):
        for tensor in tensors:
            tensor.grad = None


def _redirect_all(plan: _ViewPlan, views: list[Any], tensors: list[Any]) -> None:
    by_id = {module_id: views[step] for module_id, step in plan.step_of}
    by_id.update((tensor_id, tensors[index]) for tensor_id, index in plan.tensor_of)
    for step, keys in plan.redirects:
        original, state = plan.steps[step].original_ref(), views[step].__dict__
        for key in keys:
            state[key] = None if key in _DROPPED else _redirect(original.__dict__[key], by_id)


@functools.cache
def _data_ptr() -> Callable[[Any], int]:
    # The method itself, not `methodcaller`: no lookup and no bound method per tensor, on every lease.
    return sys.modules["torch"]._C.TensorBase.data_ptr  # type: ignore[no-any-return]


def _parameter_slot(tensor: Any, original: Any) -> Any:
    """What a view's parameter slot holds: an ``nn.Parameter`` where the original slot held one
    and ``tensor`` is a plain value that can be one without losing a derivative (the finite
    differences' evaluations, a float64 copy; the tape's leaves are Parameters already, see
    `fresh_leaf`). Under ``torch.func`` and on dual tensors the slot holds the transform's
    tensor as it is, as in ``torch.func.functional_call``: a Parameter would cut it from the
    transform."""
    torch = sys.modules["torch"]
    if type(tensor) is not torch.Tensor or type(original) is not torch.nn.Parameter or tensor.requires_grad:
        return tensor
    if torch._C._functorch.is_functorch_wrapped_tensor(tensor) or torch.autograd.forward_ad.unpack_dual(tensor).tangent is not None:
        return tensor
    return torch.nn.Parameter(tensor, requires_grad=False)


def differentiable_parameter(t: Any) -> bool:
    """A parameter that requires grad, held by a view it is no leaf of (a Constant module's, one
    ``where=`` leaves out): the view holds a `parameter_alias` of it, never the user's own."""
    kind: Any = type(t)  # (compared as Any: mypy would narrow ``t`` to ``object``)
    return kind is _parameter_type() and bool(t.requires_grad) and not t.is_inference()


def frozen_parameter(t: Any) -> bool:
    """A plain ``nn.Parameter`` that does not require grad (a frozen base weight): a view holds
    a `frozen_copy` of it. (A subclass, such as a quantized weight, is held as it is: its
    own data and attributes are its library's.)"""
    kind: Any = type(t)  # (compared as Any: mypy would narrow ``t`` to ``object``)
    return kind is _parameter_type() and not t.requires_grad and not t.is_inference()


def frozen_copy(t: Any) -> Any:
    """What a view holds for the frozen parameter ``t``: a parameter of its own whose memory is
    ``t``'s until either is written (`lazy_clone`), so no copy is made unless f writes. A
    library may write a module's weights inside its forward, as peft's LoRA for
    ``nn.MultiheadAttention`` does (``weight.data += delta``, then the slot re-pointed at a
    merged tensor and the unmerge applied to that one): held as it is, the user's frozen weight
    kept the delta, and every later call differentiated the wrong model."""
    return _parameter_type()(lazy_clone(t.detach()), requires_grad=False)


def parameter_alias(t: Any) -> Any:
    """``t``'s storage and flag in a parameter of the view's own: what a backward pass f runs
    inside the backward (Reformer's reversible layers) accumulates goes to its ``.grad``."""
    return _parameter_type()(t.detach(), requires_grad=True)


def fresh_leaf(tensor: Any) -> Any:
    """A new tape leaf with ``tensor``'s storage (``detach()``: in-place changes are seen) and,
    for an ``nn.Parameter``, itself a Parameter: f's code may ask (``module.get_parameter``
    refuses anything else, and ``isinstance(w, nn.Parameter)`` would silently be False)."""
    leaf = tensor.detach()
    parameter = _parameter_type()
    return parameter(leaf) if type(tensor) is parameter else leaf.requires_grad_()


@functools.cache
def _parameter_type() -> type:
    return sys.modules["torch"].nn.Parameter  # type: ignore[no-any-return]


def _copier(targets: list[Any], sources: list[Any]) -> Callable[[], Any]:
    """``targets[i].copy_(sources[i])`` for every i, as one call: plain tensors (BatchNorm
    statistics) in one ``torch._foreach_copy_`` (one dispatch for all, not one each)."""
    import torch

    if len(targets) > 1 and hasattr(torch, "_foreach_copy_") and all(type(t) is torch.Tensor for t in (*targets, *sources)):
        return functools.partial(torch._foreach_copy_, targets, sources)

    def each() -> None:
        for target, source in zip(targets, sources):
            target.copy_(source)

    return each


class ReusedView:
    """A view of a module built once and re-pointed on every call. Of an Active module
    (``active``), with tape leaves made once that alias the trainable parameters (``detach()``:
    the same storage, so in-place updates between calls are seen; fresh tensors, so no other
    use of a parameter is differentiated with them); of a Constant module, with no leaves, its
    parameters held as aliases as the ones ``where=`` leaves out are.

    Building a view and fresh leaves costs more than the forward and backward passes of a
    small model; re-pointing is two dict updates per copied submodule. A lease
    (`lease_view`) copies each original submodule's ``__dict__`` again (flags such as
    ``training``, attributes), puts the view's own slots back, overwrites its buffer copies
    with the originals (f may update them in place) and redirects methods again; its release
    (`release_view`) empties the copied modules' ``__dict__`` (their own slots are kept aside),
    so that an idle view refers to nothing of the user's module but the parameters' storage.
    Only for descriptions `still_describes` has just checked.
    """

    def __init__(self, module: ModuleDescription, convert: Callable[[Any], Any], active: bool = True) -> None:
        self.plan = plan = _plan_of(module, active)
        self.active = active
        self.leaves = tuple(map(fresh_leaf, module.params)) if active else ()
        # The view's own copy of each buffer, kept between calls. A parameter that requires grad but
        # is not differentiated (``Active(model, where=...)`` leaves it out) is held as an alias made
        # once, the same storage and flag: a backward pass f runs inside the backward (Reformer's
        # reversible layers) accumulated into the user's ``.grad``. A frozen parameter is held as a
        # `frozen_copy` made anew for each call (`_renew`): one kept between calls would go stale
        # when the user writes the weight (``merge_adapter()``), and would cost that write a copy.
        aliased = [differentiable_parameter(t) for t in plan.sources]
        renewed = [frozen_parameter(t) for t in plan.sources]
        self.held = [
            parameter_alias(t) if alias else frozen_copy(t) if frozen else convert(t)
            for t, alias, frozen in zip(plan.sources, aliased, renewed)
        ]
        self.aliases = tuple(h for h, alias in zip(self.held, aliased) if alias)
        self.renewed = tuple(i for i, frozen in enumerate(renewed) if frozen)
        # the storage each leaf and alias shares (`lease_view` builds anew where ``p.data = ...`` changed it)
        self.params = (*(module.params if active else ()), *(t for t, alias in zip(plan.sources, aliased) if alias))
        self.pointers = tuple(map(_data_ptr(), self.params))
        self.kept = tuple(
            i for i, (t, c) in enumerate(zip(plan.sources, self.held)) if c is not t and not aliased[i] and not renewed[i]
        )
        self.copy_kept = _copier([self.held[i] for i in self.kept], [plan.sources[i] for i in self.kept]) if self.kept else None
        # A copy of a tensor on a graph cannot be overwritten in place: such a view serves one call.
        self.reusable = not any(plan.sources[i].requires_grad for i in self.kept)
        copies: list[Any] = []
        attributed: list[Any] = []
        self.views = _views(plan, [*self.leaves, *self.held], copies, attributed)
        self.root = self.views[plan.root]
        self.copies = tuple(copies)
        # (state, keys) of the copied modules whose plain lists and dicts a refresh copies again
        self.plain = tuple((state, step.copied) for step, (_, state, _) in zip(plan.steps, copies) if step.copied)
        self.attributed = attributed
        self.attributed_sides = (tuple(t for t, _ in attributed), tuple(p for _, p in attributed))
        # Where each held tensor goes: (slots dict, key, what the view put there), and where each
        # frozen copy goes: (slots dict, key, its index in ``held``).
        n, renew = len(self.leaves), {i + len(self.leaves) for i in self.renewed}
        self.refills = tuple(
            (slots, key, slots[key])
            for step, (_, _, own) in zip(plan.steps, copies)
            for slots, entries in ((own["_parameters"], step.params), (own["_buffers"], step.buffers))
            for key, i in entries
            if i >= n and i not in renew
        )
        self.renewed_slots = tuple(
            (own["_parameters"], key, i - n) for step, (_, _, own) in zip(plan.steps, copies) for key, i in step.params if i in renew
        )
        # (index into ``attributed``, index into ``held``) of the frozen copies carrying attributes
        sourced = [i for step in plan.steps for _, i in step.attributed]
        self.renewed_attributed = tuple((at, i - n) for at, i in enumerate(sourced) if i in renew)
        # (view's __dict__, own slots, original) of the RNNs whose weight lists hold frozen copies
        self.renewed_rnns = tuple(
            (state, own, original_ref)
            for step, (original_ref, state, own) in zip(plan.steps, copies)
            if step.rnn and any(i in renew for _, i in step.params)
        )
        self.copied = tuple(self.views)
        self.held_copies = tuple(self.held[i] for i in self.kept)
        self.references = self._references()

    def _references(self) -> tuple[int, ...]:
        # References to each copied submodule and buffer, ours only while no call holds them: more
        # at release means f kept one (a module, a buffer in its aux), which must then stay as it is.
        # (Maps, not a generator: this runs on every call, after the backward pass has left every cache cold.)
        counts = tuple(map(sys.getrefcount, self.copied))
        return counts + tuple(map(sys.getrefcount, self.held_copies)) if self.held_copies else counts

    def refresh(self) -> None:
        # A call that raised after a backward pass of f's own left .grad behind: f sees none, as in its first call
        clear_grads(self.leaves)
        clear_grads(self.aliases)
        for original_ref, state, own in self.copies:
            state.update(original_ref().__dict__)
            state.update(own)
        if self.renewed:
            self._renew()
        if self.plain:
            plain: dict[int, Any] = {}
            for state, keys in self.plain:
                _copy_plain(state, keys, plain)
        # Every call: f may have changed a copy (BatchNorm statistics), and kernels that update
        # them do not all move the version counter, so nothing tells whether it did.
        if self.copy_kept is not None:
            self.copy_kept()
        for slots, key, tensor in self.refills:
            slots[key] = tensor  # f may have assigned another tensor to the slot
        if self.attributed and not _all_same_attributes(*self.attributed_sides):
            for tensor, parameter in self.attributed:  # as the user's parameters carry them now
                if not _same_attributes(tensor.__dict__, parameter.__dict__):
                    _attributes_of(tensor, parameter)
        if self.plan.redirects:
            _redirect_all(self.plan, self.views, [*self.leaves, *self.held])

    def empty(self) -> bool:
        """Empty an idle view's copied modules (`refresh` fills them again, own slots last); False
        (nothing changed) where it cannot serve again: f kept a module or buffer of it, or its
        buffer copies cannot be overwritten."""
        if not self.reusable or self._references() != self.references:
            return False
        for _, state, _ in self.copies:
            state.clear()
        if self.renewed:  # an idle view holds no frozen copy: it would cost the user's next write of the weight a copy
            for i in self.renewed:
                self.held[i] = None
            for slots, key, _ in self.renewed_slots:
                slots[key] = None
            if self.renewed_attributed:
                for at, i in self.renewed_attributed:
                    self.attributed[at] = (None, self.plan.sources[i])
                self.attributed_sides = ((), ())
            for _, own, _ in self.renewed_rnns:
                own["_flat_weights"] = []
        return True

    def _renew(self) -> None:
        """New frozen copies, in their slots (after `refresh` has filled the copied modules)."""
        held, sources = self.held, self.plan.sources
        for i in self.renewed:
            held[i] = frozen_copy(sources[i])
        for slots, key, i in self.renewed_slots:
            slots[key] = held[i]
        if self.renewed_attributed:
            for at, i in self.renewed_attributed:
                self.attributed[at] = (_attributes_of(held[i], sources[i]), sources[i])
            self.attributed_sides = (tuple(t for t, _ in self.attributed), tuple(p for _, p in self.attributed))
        for state, own, original_ref in self.renewed_rnns:
            _flat_weights(state, original_ref())
            own.update((key, state[key]) for key in _RNN_WEIGHTS if key in state)


def forget_hooks_since(descriptions: Any, first: int) -> None:
    """Remove the hooks registered from handle id ``first`` on in the described modules.

    A view shares its original's hook dicts (f runs the user's hooks), so a hook that f
    registers on a view lands in the user's module, while an attribute f sets on the view
    does not: Hugging Face installs its output-capturing hooks on a model's first forward and
    marks the model, and a first forward inside activity left the hooks without the mark, so
    the next forward installed them again (every hidden state captured twice, a wrong
    ``last_hidden_state``). Called when f has registered a hook (``RemovableHandle.next_id``
    moved), after f and before the backward pass, whose hooks the forward pass has captured.
    """
    for description in descriptions:
        for module_ref in description.module_refs:
            module = module_ref()
            if module is None:
                continue
            state = module.__dict__
            for name in _HOOK_DICTS:
                hooks = state.get(name)
                if hooks:
                    for key in [key for key in hooks if isinstance(key, int) and key >= first]:
                        del hooks[key]


VERSION = operator.attrgetter("_version")  # a tensor's version counter (in-place writes move it)


def tensor_versions(descriptions: Any) -> list[int]:
    """The version counters of the described modules' parameters and buffers. A view's tape
    leaves alias the parameters (``detach()`` shares the counter), so an in-place write by f
    that no tape sees (under ``torch.no_grad()``) moves the user's own counter."""
    versions: list[int] = []
    for description in descriptions:
        if not description.has_inference:  # inference tensors have no counter; a view clones them
            versions.extend(map(VERSION, description.tensors))
    return versions


def watched_call(
    described: dict[Any, Any], call: Callable[..., Any], f: Any, values: Any, op_name: str, label: Callable[[int], str],
    check_writes: bool,
) -> Any:
    """``call(f, values)`` where f's arguments hold torch modules: hooks f registers on their
    views are taken off again (`forget_hooks_since`); with ``check_writes``, writes f makes to
    their tensors outside the tape are warned of (`tensor_versions`)."""
    handles, descriptions = hook_handles(), described.values()
    first, versions = handles.next_id, tensor_versions(descriptions) if check_writes else None
    try:
        return call(f, values)
    finally:
        if handles.next_id != first:
            forget_hooks_since(descriptions, first)
        if versions is not None and tensor_versions(descriptions) != versions:
            warn_changed_tensors(described, versions, op_name, label)


def hook_handles() -> Any:
    """torch's hook handle class, whose ``next_id`` counts every hook registered."""
    return sys.modules["torch.utils.hooks"].RemovableHandle


def warn_changed_tensors(described: dict[Any, Any], versions: list[int], op_name: str, label: Callable[[int], str]) -> None:
    """Say which of the user's parameters f wrote in place (see `tensor_versions`)."""
    changed: list[str] = []
    index = 0
    for (position, _), description in described.items():
        if description.has_inference:
            continue
        names = [entry[0] for entry in description.layout if isinstance(entry, tuple)]
        for name, tensor in zip(names, description.tensors):
            if tensor._version != versions[index]:
                changed.append(f"{name} of {label(position)}")
            index += 1
    warnings.warn(
        f"activity.{op_name}: f wrote {', '.join(changed[:3])}{' and more' if len(changed) > 3 else ''} in place "
        f"outside the tape (under torch.no_grad(); nn.Embedding(max_norm=...) renormalizes the rows it looks up "
        f"so), and the view f runs shares the parameters' storage: your module was changed, as a plain call "
        f"would change it, and the derivatives are taken at the values f used. Keep f from writing its "
        f"parameters (renormalize outside f, or pass a copy of the module).",
        RuntimeWarning,
        stacklevel=caller_stacklevel(),
    )


# The hook dicts of a module, keyed by handle id (`torch.utils.hooks.RemovableHandle`).
_HOOK_DICTS = (
    "_backward_pre_hooks",
    "_backward_hooks",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


_IDLE_VIEWS = 4  # per description: enough for a few threads or nested calls at once


def lease_view(module: ModuleDescription, convert: Callable[[Any], Any], active: bool = True) -> ReusedView:
    """An idle `ReusedView` of ``module`` (as an Active module, or a Constant one), refreshed (a
    new one if none is idle: another thread or a nested call holds it); give it back with
    `release_view` (after dropping every reference to its modules)."""
    idle = module.reused if active else module.reused_constant
    try:
        view: ReusedView = idle.pop()
    except IndexError:
        return ReusedView(module, convert, active)
    if tuple(map(_data_ptr(), view.params)) != view.pointers:  # `p.data = ...` gave a parameter new storage
        idle.clear()
        return ReusedView(module, convert, active)
    view.refresh()
    return view


def release_view(module: ModuleDescription, view: ReusedView) -> None:
    idle = module.reused if view.active else module.reused_constant
    if len(idle) < _IDLE_VIEWS and view.empty():
        idle.append(view)


__all__ = [
    "ModuleDescription",
    "ReusedView",
    "bound_view",
    "differentiable_parameter",
    "parameter_alias",
    "clear_grads",
    "describe_module",
    "described",
    "forget_hooks_since",
    "fresh_leaf",
    "frozen_copy",
    "frozen_parameter",
    "grads_left",
    "lease_view",
    "release_view",
    "tensor_guard",
    "VERSION",
    "tensor_versions",
    "warn_changed_tensors",
]

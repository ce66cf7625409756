"""Pytree utilities shared by every backend.

Trees are flattened with optree in a private namespace, so a user's classes
work as pytrees on every backend without touching any global registry. A type
optree does not know is registered in that namespace on first sight, and
round-trips the way its own library defines:

1. types optree knows (natively, or registered in its global namespace) never
   reach this module: optree flattens them before they are seen as leaves;
2. types registered with JAX (Equinox modules) use JAX's flatten/unflatten;
3. types registered with torch's pytree (Hugging Face ``ModelOutput``), once
   torch is imported, use torch's;
4. a ``collections.UserDict`` (Hugging Face's ``BatchEncoding``) item by item, a
   torch_geometric ``Data`` or ``Batch`` attribute by attribute, a ``HeteroData`` (or a
   batch of them) storage by storage;
5. other attrs and dataclass instances are flattened field by field (a
   dataclass that is also a mapping, item by item).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import functools
import sys
import types
import weakref
from typing import Any, Callable

import attrs
import optree

from ._errors import short_repr

NAMESPACE = "activity"

_node_types: dict[type, bool] = {}  # type -> "registered as a node in NAMESPACE"


# ------------------------------------------------------------------ JAX


def _jax_registered(value: Any) -> bool:
    if "jax" not in sys.modules:
        return False
    import jax

    treedef = jax.tree_util.tree_structure(value, is_leaf=lambda node: node is not value)
    return not (treedef.num_nodes == 1 and treedef.num_leaves == 1)  # type: ignore[attr-defined]


def _register_jax_node(cls: type) -> None:
    import jax

    def flatten(node: Any) -> tuple[list[Any], _JaxNode, tuple[Any, ...]]:
        pairs, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda n: n is not node)
        entries = tuple(_entry(node, path, child) for path, child in pairs)
        return [child for _, child in pairs], _JaxNode(treedef), entries

    def _entry(node: Any, path: Any, child: Any) -> str:
        """A child's path as messages print it. A node registered without keys (a
        ``jax.experimental.sparse.BCOO``) has its children named ``[<flat index 0>]`` by JAX;
        where one attribute of the node holds exactly that child (``BCOO.data``), its name
        (``.data``) says which part of the object a mismatch or a ``where=`` is about."""
        if len(path) == 1 and isinstance(path[0], jax.tree_util.FlattenedIndexKey):
            names = [name for name, value in getattr(node, "__dict__", {}).items() if value is child]
            if len(names) == 1 and names[0].isidentifier() and not names[0].startswith("_"):
                return "." + str(names[0])
        return str(jax.tree_util.keystr(path))

    optree.register_pytree_node(cls, flatten, lambda node, children: node.treedef.unflatten(children), namespace=NAMESPACE)  # type: ignore[union-attr]


class _JaxNode:
    """A JAX node's one-level treedef as the metadata optree compares and hashes. JAX's own
    comparison raises where the node's static data holds an array (an Equinox
    ``eqx.field(static=True)`` array, which Equinox warns of but runs): such data compares
    item by item here, the same array object or an equal one matching, as static leaves do."""

    __slots__ = ("treedef",)

    def __init__(self, treedef: Any):
        self.treedef = treedef

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _JaxNode):
            return NotImplemented
        try:
            return bool(self.treedef == other.treedef)
        except ValueError:  # an array in the static data: JAX cannot tell
            (type_a, data_a), (type_b, data_b) = self.treedef.node_data(), other.treedef.node_data()
            return type_a is type_b and same_static_value(data_a, data_b)

    def __hash__(self) -> int:
        try:
            return hash(self.treedef)
        except TypeError:  # unhashable static data: equal nodes still share this hash
            return hash(self.treedef.node_data()[0])

    def __repr__(self) -> str:
        return repr(self.treedef)


def same_static_value(a: Any, b: Any) -> bool:
    """Whether two static values (a node's aux data, a non-array leaf compiled in) are the same
    signature: the same object, or of one type and equal (2 and 2.0, 1 and True differ, as f
    may treat them differently); lists and tuples item by item, arrays elementwise; values
    whose ``==`` is no bool only by identity."""
    if a is b:
        return True
    if isinstance(a, (list, tuple)) and type(a) is type(b):
        return len(a) == len(b) and all(map(same_static_value, a, b))
    if type(a) is not type(b):
        return False
    try:
        if hasattr(a, "shape") and hasattr(a, "dtype"):  # an array: == is elementwise
            return bool(a.shape == b.shape and a.dtype == b.dtype and (a == b).all())
        return bool(a == b)
    except Exception:  # noqa: BLE001 - data whose == is not a bool compares by identity
        return False


# ------------------------------------------------------------------ torch


def _torch_node(cls: type) -> Any:
    """torch's pytree definition of ``cls`` (a ``NodeDef``), or None.

    Only when torch's pytree module is already imported: this module never
    imports torch, and nothing can be registered with a module not loaded.
    """
    pytree = sys.modules.get("torch.utils._pytree")
    return None if pytree is None else pytree.SUPPORTED_NODES.get(cls)


def _register_torch_node(cls: type, node: Any) -> None:
    def flatten(value: Any) -> tuple[list[Any], _Context, tuple[Any, ...]]:
        if node.flatten_with_keys_fn is None:
            children, context = node.flatten_fn(value)
            entries = tuple(f"[{index}]" for index in range(len(children)))
        else:  # keys such as MappingKey('logits') print as the paths users write: ['logits']
            pairs, context = node.flatten_with_keys_fn(value)
            children, entries = [child for _, child in pairs], tuple(str(key) for key, _ in pairs)
        return children, _Context(context), entries

    def unflatten(context: _Context, children: Any) -> Any:
        return node.unflatten_fn(list(children), context.value)

    optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)  # type: ignore[arg-type]


class _Context:
    """torch's pytree context (often a list, e.g. a ModelOutput's keys) as the hashable
    metadata optree stores in a structure: structures are compared and used as cache keys."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Context):
            return NotImplemented
        return same_static_value(self.value, other.value)

    def __hash__(self) -> int:
        try:
            return hash(_frozen(self.value))
        except TypeError:  # unhashable inside: equal contexts still share this hash
            return hash(type(self.value))

    def __repr__(self) -> str:
        return repr(self.value)


def _frozen(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(map(_frozen, value))
    if isinstance(value, dict):  # equal dicts in another order must hash alike
        return frozenset((key, _frozen(item)) for key, item in value.items())
    return value


# ------------------------------------------------------------------ attrs and dataclasses


def _register_fields_node(cls: type, fields: list[tuple[str, bool]]) -> None:
    """``cls`` flattened field by field; ``fields`` are (name, taken by __init__).

    The attributes an instance holds besides its fields (what a ``__post_init__`` sets: a
    jaxopt solver's derived functions, a config's lookup table) are children too, after the
    fields: a node rebuilt without ``__init__`` would lack them. Their names are the node's
    metadata, so an instance with other attributes is another structure. A
    ``functools.cached_property`` value is left out: the rebuilt node computes it again from
    its own fields (a cached value of the user's instance would be stale under a transform)."""
    names = tuple(name for name, _ in fields)
    cached = frozenset(
        name for klass in cls.__mro__ for name, member in vars(klass).items() if isinstance(member, functools.cached_property)
    )

    def extra_names(node: Any) -> tuple[str, ...]:
        attributes = getattr(node, "__dict__", {})
        return tuple(name for name in attributes if name not in names and name not in cached)

    def flatten(node: Any) -> tuple[list[Any], tuple[str, ...], tuple[Any, ...]]:
        extras = extra_names(node)
        children = [*(getattr(node, name) for name in names), *(vars(node)[name] for name in extras)]
        return children, extras, tuple("." + name for name in (*names, *extras))

    build = _builder(cls, fields)

    def unflatten(extras: tuple[str, ...], children: Any) -> Any:
        children = list(children)
        node = build(children[: len(names)])
        for name, child in zip(extras, children[len(names) :]):
            object.__setattr__(node, name, child)  # frozen classes allow object.__setattr__
        return node

    optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)  # type: ignore[arg-type]


def _builder(cls: type, fields: list[tuple[str, bool]]) -> Callable[[Any], Any]:
    """How to rebuild an instance of ``cls`` from its field values.

    Without __init__ where possible: it may validate or convert, and a result
    holds None at non-floating leaves. That needs a ``__new__`` that takes no
    arguments (object's, or a builtin base's such as dict's, which
    ``object.__new__`` refuses); a class with its own ``__new__`` is built
    through its constructor instead, with the fields __init__ takes.
    """
    names = tuple(name for name, _ in fields)
    owner = next(klass for klass in cls.__mro__ if "__new__" in vars(klass))
    if owner is object or owner.__module__ == "builtins":

        def blank(children: Any) -> Any:
            node = cls.__new__(cls)  # type: ignore[call-overload]
            for name, child in zip(names, children):
                object.__setattr__(node, name, child)  # frozen classes allow object.__setattr__
            return node

        return blank

    def construct(children: Any) -> Any:
        values = dict(zip(names, children))
        node = cls(**{name: values[name] for name, init in fields if init})
        for name, init in fields:
            if not init:
                object.__setattr__(node, name, values[name])
        return node

    return construct


def _register_mapping_node(cls: type) -> None:
    """A dataclass that is also a mapping (a dict subclass): its items are its content, which
    its own fields need not match, so it is flattened item by item and rebuilt through its
    constructor with the items as keywords (the only way to fill both its fields and its
    items; a Hugging Face ModelOutput unknown to torch's pytree is rebuilt the same way)."""

    def flatten(node: Any) -> tuple[list[Any], tuple[Any, ...], tuple[Any, ...]]:
        keys = tuple(node.keys())
        for key in keys:
            if not isinstance(key, str):
                raise TypeError(
                    f"{cls.__name__} is a dataclass and a mapping with the non-string key {key!r}, so activity "
                    f"cannot rebuild it as {cls.__name__}(**items). Register {cls.__name__} as a pytree node "
                    f"(optree.register_pytree_node, torch.utils._pytree.register_pytree_node or "
                    f"jax.tree_util.register_pytree_node) to say how it is flattened and rebuilt."
                )
        return [node[key] for key in keys], keys, tuple(f"[{key!r}]" for key in keys)

    def unflatten(keys: tuple[Any, ...], children: Any) -> Any:
        return cls(**dict(zip(keys, children)))

    optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)  # type: ignore[arg-type]


def _register_user_dict_node(cls: type) -> None:
    """A ``collections.UserDict`` (a Hugging Face ``BatchEncoding`` or ``BatchFeature``, what a
    tokenizer or feature extractor returns) holds its items in ``.data``: flattened item by item
    like a dict, so new batches of the same layout are new values, not a different constant.
    Its other attributes are children too (after the items), never metadata of the structure:
    a prepared call compares and rebuilds them as it does any leaf, so none is carried over
    stale from the preparation values."""

    def flatten(node: Any) -> tuple[list[Any], tuple[Any, ...], tuple[Any, ...]]:
        keys = tuple(node.data)
        names = tuple(name for name in vars(node) if name != "data")
        children = [*(node.data[key] for key in keys), *(vars(node)[name] for name in names)]
        return children, (keys, names), (*(f"[{key!r}]" for key in keys), *("." + name for name in names))

    def unflatten(context: tuple[tuple[Any, ...], tuple[str, ...]], children: Any) -> Any:
        keys, names = context
        children = list(children)
        node = cls.__new__(cls)  # type: ignore[call-overload]
        vars(node).update(zip(names, children[len(keys) :]))
        node.data = dict(zip(keys, children[: len(keys)]))
        return node

    optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)  # type: ignore[arg-type]


def _is_pyg_data(cls: type) -> bool:
    """Whether ``cls`` is a torch_geometric ``Data`` (a ``Batch`` of graphs included)."""
    data = sys.modules.get("torch_geometric.data")  # a type of a library not imported cannot be this one
    return data is not None and issubclass(cls, data.Data)


def _register_pyg_data_node(cls: type) -> None:
    """A torch_geometric ``Data`` or ``Batch`` (a graph: ``x``, the int ``edge_index``, a
    ``batch`` vector) keeps its attributes in one storage, ``data._store``: flattened attribute
    by attribute, so another graph of the same sizes is new values of one signature, not a
    different constant (a ``Data`` compares by identity), and a graph of other sizes is told
    by the attribute that changed. The storage's private attributes (a ``Batch``'s
    ``_slice_dict``, ``_inc_dict``, ``_num_graphs``, what ``to_data_list()`` reads) and the
    object's own are children too, never carried over stale from the preparation values;
    its cache of attribute kinds is left to rebuild itself. Rebuilt without ``__setattr__``,
    which would drop an attribute set to the ``None`` a result holds at an int leaf."""

    def flatten(node: Any) -> tuple[list[Any], tuple[Any, ...], tuple[Any, ...]]:
        store = vars(node)["_store"]
        keys = tuple(store._mapping)
        private = tuple(name for name in vars(store) if name not in ("_mapping", "_parent", "_cached_attr"))
        own = tuple(name for name in vars(node) if name != "_store")
        children = [*store._mapping.values(), *(vars(store)[name] for name in private), *(vars(node)[name] for name in own)]
        paths = (*("." + key for key in keys), *("." + name for name in (*private, *own)))
        return children, (type(store), keys, private, own), paths

    def unflatten(context: tuple[type, tuple[str, ...], tuple[str, ...], tuple[str, ...]], children: Any) -> Any:
        storage, keys, private, own = context
        children = list(children)
        node = cls.__new__(cls)  # type: ignore[call-overload]
        store = storage.__new__(storage)  # type: ignore[call-overload]
        vars(store).update(_mapping=dict(zip(keys, children)), _parent=weakref.ref(node))
        vars(store).update(zip(private, children[len(keys) :]))
        vars(node).update(zip(own, children[len(keys) + len(private) :]), _store=store)
        return node

    optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)  # type: ignore[arg-type]


def _is_pyg_hetero_data(cls: type) -> bool:
    """Whether ``cls`` is a torch_geometric ``HeteroData`` (a batch of them included)."""
    data = sys.modules.get("torch_geometric.data")
    return data is not None and issubclass(cls, data.HeteroData)


# A storage's attributes that are not carried as children: its items (children of their own),
# the weak reference to its graph (made anew for the rebuilt graph), and a cache of attribute
# kinds that rebuilds itself.
_PYG_STORE_INTERNALS = ("_mapping", "_parent", "_key", "_cached_attr")
_PYG_HETERO_STORES = ("_global_store", "_node_store_dict", "_edge_store_dict")


def _register_pyg_hetero_data_node(cls: type) -> None:
    """A torch_geometric ``HeteroData`` (a graph with node and edge types) keeps a global
    storage and one storage per node type and per edge type: flattened item by item, as a
    ``Data``'s single storage is (see `_register_pyg_data_node`), so another graph of the same
    types and sizes is new values of one signature, and a changed size is told by its path,
    ``['paper'].x`` or ``['author', 'writes', 'paper'].edge_index``. The types and their order
    are the node's structure."""

    def flatten(node: Any) -> tuple[list[Any], tuple[Any, ...], tuple[Any, ...]]:
        attributes = vars(node)
        stores: list[tuple[Any, Any]] = [(None, attributes["_global_store"])]
        stores += [(("nodes", key), store) for key, store in attributes["_node_store_dict"].items()]
        stores += [(("edges", key), store) for key, store in attributes["_edge_store_dict"].items()]
        layout, children, paths = [], [], []
        for where, store in stores:
            keys = tuple(store._mapping)
            private = tuple(name for name in vars(store) if name not in _PYG_STORE_INTERNALS)
            layout.append((where, type(store), keys, private))
            children += [*store._mapping.values(), *(vars(store)[name] for name in private)]
            prefix = "" if where is None else _pyg_store_path(where[1])
            paths += [f"{prefix}.{name}" for name in (*keys, *private)]
        own = tuple(name for name in attributes if name not in _PYG_HETERO_STORES)
        children += [attributes[name] for name in own]
        paths += ["." + name for name in own]
        return children, (tuple(layout), own), tuple(paths)

    def unflatten(context: tuple[tuple[Any, ...], tuple[str, ...]], children: Any) -> Any:
        layout, own = context
        children = iter(children)
        node = cls.__new__(cls)  # type: ignore[call-overload]
        by_kind: dict[str, dict[Any, Any]] = {"nodes": {}, "edges": {}}
        global_store = None
        for where, storage, keys, private in layout:
            store = storage.__new__(storage)
            vars(store).update(_mapping={key: next(children) for key in keys}, _parent=weakref.ref(node))
            vars(store).update((name, next(children)) for name in private)
            if where is None:
                global_store = store
            else:
                vars(store)["_key"] = where[1]
                by_kind[where[0]][where[1]] = store
        vars(node).update(_global_store=global_store, _node_store_dict=by_kind["nodes"], _edge_store_dict=by_kind["edges"])
        vars(node).update((name, next(children)) for name in own)
        return node

    optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)  # type: ignore[arg-type]


def _pyg_store_path(key: Any) -> str:
    """A storage as the user indexes the graph: ``['paper']``, ``['author', 'writes', 'paper']``."""
    return "[" + ", ".join(map(repr, key if isinstance(key, tuple) else (key,))) + "]"


def _is_hf_cache(cls: type) -> bool:
    """Whether ``cls`` is a Hugging Face key/value cache (a ``DynamicCache``, ``StaticCache``,
    ``EncoderDecoderCache``...) or one of its layers. A model's forward updates the cache it is
    given (``past_key_values``), and a ``DynamicCache`` does so by binding new tensors to its
    layers' attributes: held as an opaque constant, f's forward extended the user's cache on
    every call (4 cached positions, then 7, then 10), and a second call attended over the
    first call's keys, a wrong gradient. As a node of its layers' attributes, each call
    rebuilds it, so f extends its own copy (a ``StaticCache`` writes into its tensors in place,
    as f may write into any Constant tensor: docs/pytorch-models.md says to pass a copy), and
    ``Active(past)`` differentiates the cached keys and values."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    if cache_utils is None:
        return False
    # (a linear-attention layer, the conv and recurrent states of a hybrid model's Mamba or
    # gated-delta layers, has a base of its own: as an opaque constant, a prepared call refused
    # every new cache of Jamba, LFM2, Qwen3-Next..., and f's forward wrote into the user's layer)
    names = ("Cache", "CacheLayerMixin", "LinearAttentionCacheLayerMixin", "DummyLayer")
    bases = tuple(getattr(cache_utils, name, None) for name in names)
    return any(base is not None and issubclass(cls, base) for base in bases)


def _fields(cls: type) -> list[tuple[str, bool]] | None:
    if attrs.has(cls):
        return [(a.name, a.init) for a in attrs.fields(cls)]
    if dataclasses.is_dataclass(cls):
        return [(f.name, f.init) for f in dataclasses.fields(cls)]
    return None


# ------------------------------------------------------------------ learning types


def _learn_type(value: Any) -> bool:
    """Register ``type(value)`` as a node if it is a container we understand."""
    cls = type(value)
    known = _node_types.get(cls)
    if known is not None:
        return False
    if isinstance(value, type) or getattr(cls, "__activity_leaf__", False):
        _node_types[cls] = False
    elif _jax_registered(value):
        _register_jax_node(cls)
        _node_types[cls] = True
    elif (node := _torch_node(cls)) is not None:
        _register_torch_node(cls, node)
        _node_types[cls] = True
    elif isinstance(value, collections.UserDict):
        _register_user_dict_node(cls)
        _node_types[cls] = True
    elif _is_pyg_data(cls):
        _register_pyg_data_node(cls)
        _node_types[cls] = True
    elif _is_pyg_hetero_data(cls):
        _register_pyg_hetero_data_node(cls)
        _node_types[cls] = True
    elif _is_hf_cache(cls):
        _register_fields_node(cls, [])  # every attribute a child, rebuilt without __init__
        _node_types[cls] = True
    elif (fields := _fields(cls)) is not None:
        if issubclass(cls, collections.abc.Mapping):
            _register_mapping_node(cls)
        else:
            _register_fields_node(cls, fields)
        _node_types[cls] = True
    else:
        _node_types[cls] = False
    return _node_types[cls]


LEAF = optree.tree_structure(0, namespace=NAMESPACE)  # type: ignore[arg-type]  # the structure of any single leaf


def flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[Any], optree.PyTreeSpec]:
    """Leaves and structure of ``tree``; ``None`` is an empty node, not a leaf. With
    ``is_leaf``, a node it answers True for is a leaf, not flattened further."""
    while True:
        leaves, spec = optree.tree_flatten(tree, is_leaf=is_leaf, namespace=NAMESPACE)
        learned = False
        for leaf in leaves:
            if type(leaf) not in _node_types and not (is_leaf is not None and is_leaf(leaf)):
                learned |= _learn_type(leaf)
        if not learned:
            return leaves, spec


def unflatten(spec: optree.PyTreeSpec, leaves: Any) -> Any:
    try:
        return optree.tree_unflatten(spec, leaves)
    except Exception:
        # A namedtuple whose own __new__ validates its fields (torch's PackedSequence) refuses
        # the None a result holds at its non-floating leaves: build such nodes as the
        # namedtuple's own _make does, without __new__ (as `_builder` builds fields nodes).
        if not _has_validating_namedtuple(spec):
            raise
        return _unflatten_without_new(spec, iter(leaves))


def rebuilder(spec: optree.PyTreeSpec) -> Callable[[Any], Any]:
    """``leaves -> unflatten(spec, leaves)``, for a structure rebuilt on every call.

    A structure of dicts, lists, tuples, namedtuples and None (what gradients mostly are)
    is rebuilt by a function generated for it, one expression that builds the containers
    as a literal would: two to three times faster than optree's unflatten, which walks
    the structure. Other structures take optree's unflatten (or, with a namedtuple whose
    ``__new__`` may refuse the leaves, `unflatten`)."""
    generated = _generated_rebuilder(spec)
    if generated is not None:
        return generated
    if _has_validating_namedtuple(spec):
        return functools.partial(unflatten, spec)
    return functools.partial(optree.tree_unflatten, spec)


_LITERAL_KINDS = frozenset({
    optree.PyTreeKind.LEAF, optree.PyTreeKind.NONE, optree.PyTreeKind.TUPLE, optree.PyTreeKind.LIST,
    optree.PyTreeKind.DICT, optree.PyTreeKind.NAMEDTUPLE,
})
_MAX_GENERATED_NODES = 2000  # beyond, compiling the expression costs more than it saves
_MAX_GENERATED_DEPTH = 40  # Python's parser nests literals only so deep


class _Slot:
    """Where a leaf goes, in the sample structure a rebuilder is generated from."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def _generated_rebuilder(spec: optree.PyTreeSpec) -> Callable[[Any], Any] | None:
    nodes = _nodes(spec)
    if len(nodes) > _MAX_GENERATED_NODES or any(node.kind not in _LITERAL_KINDS for node in nodes):
        return None
    if spec.is_leaf():
        return None  # a single leaf is never rebuilt (`rebuilder` callers pass containers)
    # optree rebuilds dicts in their original key order: a sample built by it shows that order
    sample = _unflatten_without_new(spec, iter(_Slot(index) for index in range(spec.num_leaves)))
    names: dict[str, Any] = {"_new_tuple": tuple.__new__}

    def constant(value: Any) -> str:
        if type(value) in (str, int, bool) and repr(value).isprintable():
            return repr(value)
        name = f"_c{len(names)}"
        names[name] = value
        return name

    def source(node: Any, depth: int) -> str:
        if depth > _MAX_GENERATED_DEPTH:
            raise RecursionError
        if type(node) is _Slot:
            return f"leaves[{node.index}]"
        if node is None:
            return "None"
        if type(node) is dict:
            return "{" + ", ".join(f"{constant(key)}: {source(value, depth + 1)}" for key, value in node.items()) + "}"
        items = [source(item, depth + 1) for item in node]
        if type(node) is list:
            return "[" + ", ".join(items) + "]"
        inner = "(" + "".join(item + ", " for item in items) + ")"
        return inner if type(node) is tuple else f"_new_tuple({constant(type(node))}, {inner})"  # a namedtuple, as `_make` builds it

    try:
        body = source(sample, 0)
    except RecursionError:
        return None
    code = compile(f"lambda leaves: {body}", "<activity rebuilder>", "eval")
    rebuild = eval(code, names)  # noqa: S307 - the source is built above from the structure's kinds only
    # for a caller that inlines the expression (`specialised_call`): it reads ``leaves``
    rebuild.source, rebuild.names = body, names
    return rebuild  # type: ignore[no-any-return]


def _has_validating_namedtuple(spec: optree.PyTreeSpec) -> bool:
    return any(node.kind == optree.PyTreeKind.NAMEDTUPLE and node.type.__new__ is not tuple.__new__ for node in _nodes(spec))


def _nodes(spec: optree.PyTreeSpec) -> list[optree.PyTreeSpec]:
    found, pending = [], [spec]
    while pending:
        node = pending.pop()
        found.append(node)
        pending.extend(node.children())
    return found


def _unflatten_without_new(spec: optree.PyTreeSpec, leaves: Any) -> Any:
    if spec.is_leaf():
        return next(leaves)
    children = [_unflatten_without_new(child, leaves) for child in spec.children()]
    if spec.kind == optree.PyTreeKind.NAMEDTUPLE:
        return tuple.__new__(spec.type, children)  # type: ignore[arg-type]  # a namedtuple node has its type
    return spec.one_level().unflatten(children)  # type: ignore[union-attr]  # a node has one level


def leaf_parents(tree: Any) -> list[Any]:
    """The node that directly holds each leaf of ``tree``, in ``flatten`` order (None for a
    tree that is one leaf): whether a leaf sits in a plain dict or inside a model's object."""
    flatten(tree)  # registers any new node types first
    parents: list[Any] = []

    def visit(node: Any, parent: Any) -> None:
        children, spec = _one_level(node)
        if spec.is_leaf():
            parents.append(parent)
            return
        for child in children:
            visit(child, node)

    visit(tree, None)
    return parents


def leaf_paths(tree: Any, prefix: str = "") -> list[str]:
    """Readable paths of the leaves of ``tree``, in ``flatten`` order (for error messages)."""
    flatten(tree)  # registers any new node types first
    accessors, _, _ = optree.tree_flatten_with_accessor(tree, namespace=NAMESPACE)
    return [prefix + _codify(accessor) for accessor in accessors]


def _codify(accessor: Any) -> str:
    parts = []
    for entry in accessor:
        name = getattr(entry, "entry", None)
        if isinstance(name, str) and name.startswith((".", "[")):
            parts.append(name)  # entries we registered are already written as paths
        else:
            parts.append(entry.codify(""))
    return "".join(parts)


def structure_difference(expected: Any, got: Any, prefix: bool = False, limit: int = 3) -> str:
    """Where ``got`` differs from the structure ``expected``, in one line of paths (for messages):
    ``"missing ['b']; unexpected ['ww'] (did you mean 'w'?); a list at ['c'] where a tuple is
    expected"``. Either side is a tree or a ``PyTreeSpec``; ``expected`` is the structure the
    user's ``got`` must have (the Active value's, f's output's). With ``prefix``, ``got`` may stop
    above ``expected``'s leaves (a mask: a leaf of it stands for every leaf below it). Each kind
    of difference names its first ``limit`` paths. This is the one place structures are told in
    messages: a raw ``PyTreeSpec(...)`` means nothing to a user."""
    want, have = _as_tree(expected), _as_tree(got)
    try:
        return _walked_difference(want, have, prefix, limit)
    except Exception:  # noqa: BLE001 - a node that cannot be walked one level: tell the leaf paths alone
        want_paths, have_paths = leaf_paths(want), leaf_paths(have)
        missing = [path for path in want_paths if path not in set(have_paths)]
        extra = [path for path in have_paths if path not in set(want_paths)]
        parts = [f"missing {_some(missing, limit)}"] * bool(missing) + [f"unexpected {_some(extra, limit)}"] * bool(extra)
        return "; ".join(parts) or "the same paths, in another structure"


def _walked_difference(want: Any, have: Any, prefix: bool, limit: int) -> str:
    """`structure_difference` of two trees, walked node by node from the root."""
    flatten(have)  # registers any new node types first
    missing: list[str] = []
    unexpected: list[str] = []
    changed: list[str] = []
    pending = [("", want, have)]
    while pending:
        path, w, h = pending.pop(0)
        w_children, w_spec = _one_level(w)
        h_children, h_spec = _one_level(h)
        if h_spec.is_leaf() and (w_spec.is_leaf() or prefix):
            continue
        where = path or "the root"
        retyped = w_spec.is_leaf() or h_spec.is_leaf() or type(w) is not type(h)
        if retyped:
            changed.append(f"{_node_name(h, h_spec)} at {where} where {_node_name(w, w_spec)} is expected")
            if w_spec.is_leaf() or h_spec.is_leaf() or not set(_entries(w)) & set(_entries(h)):
                continue  # nothing below to compare; else (a dict for an nnx.State) say what differs inside too
        w_entries, h_entries = _entries(w), _entries(h)
        if w_entries != h_entries:
            lacking = [entry for entry in w_entries if entry not in h_entries]
            extra = [entry for entry in h_entries if entry not in w_entries]
            missing += [path + entry for entry in lacking]
            unexpected += [path + entry + _did_you_mean(entry, lacking) for entry in extra]
            if not lacking and not extra:
                changed.append(f"the entries at {where} are in another order")
            pairs = dict(zip(h_entries, h_children))
            pending += [(path + entry, child, pairs[entry]) for entry, child in zip(w_entries, w_children) if entry in pairs]
        elif w_spec != h_spec and not retyped:
            changed.append(
                "the static data of a node differs (a field not flattened as a leaf: an eqx.field(static=True), "
                "a register_dataclass meta field, a function a distribution holds)"
                + _static_data_difference(w, h, path)
            )
        else:
            pending += [(path + entry, *pair) for entry, pair in zip(w_entries, zip(w_children, h_children))]
    parts = [f"missing {_some(missing, limit)}"] * bool(missing) + [f"unexpected {_some(unexpected, limit)}"] * bool(unexpected)
    parts += changed[:limit]
    return "; ".join(parts) or "the same paths, in another structure"


def _as_tree(tree: Any) -> Any:
    """A tree for a ``PyTreeSpec`` (its leaves numbered), else ``tree`` itself."""
    if isinstance(tree, optree.PyTreeSpec):
        return unflatten(tree, list(range(tree.num_leaves)))
    return tree


def _entries(node: Any) -> list[str]:
    """The paths of ``node``'s children, one level down, as messages print them."""
    accessors = optree.tree_flatten_with_accessor(node, is_leaf=_below(node), namespace=NAMESPACE)[0]
    return [_codify(accessor) for accessor in accessors]


def _node_name(node: Any, spec: optree.PyTreeSpec) -> str:
    """What a node is, for messages: "a leaf", "None", "a dict", "a list of 2"."""
    if spec.is_leaf():
        return "a leaf"
    if node is None:
        return "None"
    name = type(node).__name__
    size = f" of {len(node)}" if isinstance(node, (list, tuple)) else ""
    return ("an " if name[:1].lower() in "aeiou" else "a ") + name + size


def _some(paths: list[str], limit: int) -> str:
    shown = ", ".join(path or "the root" for path in paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def _did_you_mean(entry: str, candidates: list[str]) -> str:
    """`` (did you mean 'w'?)`` for a misspelt key or attribute ``entry`` (``['ww']``) among the
    entries ``candidates`` a node lacks, or ""."""
    key = entry[1:-1] if entry.startswith("[") else entry
    keys = {(c[1:-1] if c.startswith("[") else c): c for c in candidates}
    if not key or key.lstrip("-").isdigit():  # list positions are no spelling
        return ""
    plain = {k.strip("'\"."): k for k in keys}
    close = difflib.get_close_matches(key.strip("'\"."), list(plain), n=1)
    return f" (did you mean {plain[close[0]]}?)" if close else ""


def _static_data_difference(expected: Any, tree: Any, start: str = "") -> str:
    """Which node's static data differs between two trees of the same leaves, and where in it,
    as ``": at ['model'], the JointDistributionSequential's [1]['callable_params']['model'][1]
    is <function joint.<locals>.<lambda>>, prepared with <function joint.<locals>.<lambda>> (another
    object)"``; "" where
    that is not told (a node no JAX treedef describes)."""
    pending = [(start, expected, tree)]
    while pending:
        path, want, have = pending.pop(0)
        want_children, want_spec = _one_level(want)
        have_children, have_spec = _one_level(have)
        if want_spec.is_leaf() or have_spec.is_leaf():
            continue
        if want_spec != have_spec:
            detail = _first_difference(_jax_node_data(want), _jax_node_data(have), "")
            if detail is None:
                return ""
            inner, then, now = detail
            now_text, then_text = short_repr(now, 80), short_repr(then, 80)
            same = " (another object)" if now_text == then_text else ""  # a new lambda of the same code
            return f": at {path or 'the root'}, the {type(have).__name__}'s {inner} is {now_text}, prepared with {then_text}{same}"
        accessors = optree.tree_flatten_with_accessor(have, is_leaf=_below(have), namespace=NAMESPACE)[0]
        pending += [(path + _codify(accessor), *pair) for accessor, pair in zip(accessors, zip(want_children, have_children))]
    return ""


def _below(node: Any) -> Callable[[Any], bool]:
    """An ``is_leaf`` that flattens ``node`` one level: everything below it is a leaf."""
    return lambda child: child is not node


def _one_level(node: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    return optree.tree_flatten(node, is_leaf=_below(node), namespace=NAMESPACE)


def _jax_node_data(node: Any) -> Any:
    """A JAX pytree node's static data (its flatten's aux), or None."""
    if not _node_types.get(type(node)) or "jax" not in sys.modules:
        return None
    import jax

    try:
        return jax.tree_util.tree_structure(node, is_leaf=lambda child: child is not node).node_data()[1]  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - no one-level treedef to read: nothing to tell
        return None


def _first_difference(then: Any, now: Any, path: str) -> tuple[str, Any, Any] | None:
    """The first place, item by item through tuples, lists and dicts, where two static values
    differ (`same_static_value`): its path, the prepared value and the new one."""
    if same_static_value(then, now):
        return None
    if isinstance(then, (tuple, list)) and type(then) is type(now) and len(then) == len(now):
        for index, (a, b) in enumerate(zip(then, now)):
            found = _first_difference(a, b, f"{path}[{index}]")
            if found is not None:
                return found
    if isinstance(then, dict) and type(now) is dict and list(then) == list(now):
        for key in then:
            found = _first_difference(then[key], now[key], f"{path}[{key!r}]")
            if found is not None:
                return found
    return (path or "static data"), then, now


def captured_values(function: Any) -> list[Any]:
    """What a function reaches besides its arguments: the contents of its closure cells and
    the globals it names (modules and classes apart), or a partial's bound arguments. For
    checks that a function does not hold something a compiled or copied call cannot follow."""
    if isinstance(function, functools.partial):
        return [*function.args, *function.keywords.values()]
    if not isinstance(function, types.FunctionType):
        return []
    closure = [value for value in closure_values(function) if not isinstance(value, (types.ModuleType, type))]
    return closure + global_values(function)


def closure_values(function: types.FunctionType) -> list[Any]:
    """What the closure cells of ``function`` hold (cells not filled yet apart)."""
    contents = []
    for cell in function.__closure__ or ():
        try:
            contents.append(cell.cell_contents)
        except ValueError:  # a cell not filled yet
            continue
    return contents


def global_values(function: types.FunctionType) -> list[Any]:
    """The globals ``function`` names (modules and classes apart)."""
    namespace = function.__globals__
    found = (namespace[name] for name in function.__code__.co_names if name in namespace)
    return [value for value in found if not isinstance(value, (types.ModuleType, type))]
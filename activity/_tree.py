"""Pytree utilities shared by every backend.

Trees are flattened with optree in a private namespace. Dataclasses, attrs
classes and types registered with JAX (Equinox modules) are registered in that
namespace on first sight, so a user's classes work as pytrees on every backend
without touching any global registry.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import attrs
import optree

NAMESPACE = "activity"

_node_types: dict[type, bool] = {}  # type -> "registered as a node in NAMESPACE"


def _jax_registered(value: Any) -> bool:
    if "jax" not in sys.modules:
        return False
    import jax

    treedef = jax.tree_util.tree_structure(value, is_leaf=lambda node: node is not value)
    return not (treedef.num_nodes == 1 and treedef.num_leaves == 1)


def _register_jax_node(cls: type) -> None:
    import jax

    def flatten(node: Any) -> tuple[list, Any, tuple]:
        pairs, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda n: n is not node)
        entries = tuple(jax.tree_util.keystr(path) for path, _ in pairs)
        return [child for _, child in pairs], treedef, entries

    optree.register_pytree_node(cls, flatten, lambda treedef, children: treedef.unflatten(children), namespace=NAMESPACE)


def _register_fields_node(cls: type, names: tuple[str, ...]) -> None:
    def flatten(node: Any) -> tuple[list, None, tuple]:
        return [getattr(node, name) for name in names], None, tuple("." + name for name in names)

    def unflatten(_: None, children: Any) -> Any:
        # Bypass __init__ (it may validate or convert); frozen classes allow object.__setattr__.
        node = object.__new__(cls)
        for name, child in zip(names, children):
            object.__setattr__(node, name, child)
        return node

    optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)


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
    elif attrs.has(cls):
        _register_fields_node(cls, tuple(a.name for a in attrs.fields(cls)))
        _node_types[cls] = True
    elif dataclasses.is_dataclass(cls):
        _register_fields_node(cls, tuple(f.name for f in dataclasses.fields(cls)))
        _node_types[cls] = True
    else:
        _node_types[cls] = False
    return _node_types[cls]


LEAF = optree.tree_structure(0, namespace=NAMESPACE)  # the structure of any single leaf


def flatten(tree: Any) -> tuple[list, optree.PyTreeSpec]:
    """Leaves and structure of ``tree``; ``None`` is an empty node, not a leaf."""
    while True:
        leaves, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
        learned = False
        for leaf in leaves:
            if type(leaf) not in _node_types:
                learned |= _learn_type(leaf)
        if not learned:
            return leaves, spec


def unflatten(spec: optree.PyTreeSpec, leaves: Any) -> Any:
    return optree.tree_unflatten(spec, leaves)


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

"""Annotations, backend objects, pytree Actives of every container kind, and the test helpers themselves."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, NamedTuple

import attrs
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import activity as ad
from activity import Active, Cache, Constant

ANNOTATIONS = [Active, Constant, Cache]

# ============================================================================ annotations


@pytest.mark.parametrize("kind", ANNOTATIONS, ids=lambda k: k.__name__)
def test_annotation_wraps_value_and_is_immutable(kind):
    x = np.arange(3.0)
    a = kind(x)
    assert a.value is x
    assert repr(a).startswith(f"{kind.__name__}(")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        a.value = np.zeros(3)
    assert kind("s") == kind("s") and kind("s") != kind("t")
    assert hash(kind(1.0)) == hash(kind(1.0))
    assert kind(1.0) != [k for k in ANNOTATIONS if k is not kind][0](1.0)  # kind is part of equality


@pytest.mark.parametrize("outer", ANNOTATIONS, ids=lambda k: k.__name__)
@pytest.mark.parametrize("inner", ANNOTATIONS, ids=lambda k: k.__name__)
def test_nested_annotation_is_a_type_error(outer, inner):
    with pytest.raises(TypeError, match=rf"{outer.__name__}\({inner.__name__}\(.*nests two annotations.*exactly one"):
        outer(inner(np.ones(2)))


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda x: Active({"w": x, "b": Constant(x)}), id="Constant-inside-Active-dict"),
        pytest.param(lambda x: Active((x, Cache(x))), id="Cache-inside-Active-tuple"),
    ],
)
def test_annotation_nested_inside_a_pytree_is_a_type_error(make):
    """An annotation inside the pytree of another is nesting too: one argument has exactly one kind.

    Otherwise the library treats the inner wrapper as a container (it is an attrs class) and
    silently differentiates the value the user marked Constant.
    """
    x = jnp.array([1.0, 2.0])
    calls = []

    def f(p):
        calls.append(1)
        return jnp.sum((p["w"] if isinstance(p, dict) else p[0]) ** 2)

    with pytest.raises(TypeError, match=r"nest|inside"):
        ad.gradient(f, make(x), backend=ad.AutoJAX())
    assert not calls, "the nesting error must be raised before f runs"


# ============================================================================ backend objects


def test_backends_are_frozen_hashable_values_with_readable_reprs():
    assert ad.AutoJAX() == ad.AutoJAX() and hash(ad.AutoJAX()) == hash(ad.AutoJAX())
    assert repr(ad.AutoJAX()) == "AutoJAX()"
    fd = ad.AutoFiniteDifferences(step=0.05)
    assert fd != ad.AutoFiniteDifferences() and fd == ad.AutoFiniteDifferences(step=0.05)
    assert repr(fd).startswith("AutoFiniteDifferences(") and "step=0.05" in repr(fd)
    so = ad.SecondOrder(ad.AutoFiniteDifferences(), ad.AutoJAX())
    assert so == ad.SecondOrder(ad.AutoFiniteDifferences(), ad.AutoJAX())
    assert so != ad.SecondOrder(ad.AutoJAX(), ad.AutoJAX())
    assert "SecondOrder(" in repr(so) and "AutoJAX()" in repr(so) and "AutoFiniteDifferences(" in repr(so)
    assert len({ad.AutoJAX(), ad.AutoJAX(), fd, so, so}) == 3
    for backend in (ad.AutoJAX(), fd, so):
        assert isinstance(backend, ad.Backend)
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            backend.step = 1.0  # type: ignore[attr-defined]


def test_backends_declare_their_support_table():
    table = ad.AutoJAX().capabilities()
    assert table[("gradient", "cache", "prepared")] is True
    assert {op for op, _, _ in table} >= {"gradient", "hessian", "hvp", "pullback", "second_derivative"}
    ad_over_fd = ad.SecondOrder(ad.AutoJAX(), ad.AutoFiniteDifferences())
    assert ad_over_fd.supports("hessian", "active") is False
    assert ad_over_fd.supports("gradient", "active") is True  # first order runs on the inner backend


def test_public_exceptions():
    assert issubclass(ad.UnsupportedError, NotImplementedError)
    assert issubclass(ad.PreparationMismatchError, ValueError)


# ============================================================================ pytree Actives
#
# f(p) = n * sum(act(w * b)) with act = sin: grad_w = n b cos(w b), grad_b = n sum(w cos(w b)).
# Every container also carries non-floating leaves: an int (n), a string, a bool, None and
# a callable; they reach f unchanged and are None in every result.


def act(z):
    return (jnp if isinstance(z, jax.Array) else np).sin(z)


class Params(NamedTuple):
    w: Any
    b: Any
    n: int
    tag: str
    act: Callable
    on: bool
    nothing: Any


@dataclasses.dataclass
class DataParams:
    w: Any
    b: Any
    n: int
    tag: str
    act: Callable
    on: bool
    nothing: Any


@attrs.frozen
class AttrsParams:
    w: Any
    b: Any
    n: int = attrs.field(validator=attrs.validators.instance_of(int))
    tag: str = attrs.field(validator=attrs.validators.instance_of(str))
    act: Callable = act
    on: bool = True
    nothing: Any = None


FIELDS = ("w", "b", "n", "tag", "act", "on", "nothing")


def _build(kind: str, values: dict) -> Any:
    if kind == "dict":
        return dict(values)
    if kind == "OrderedDict":
        return collections.OrderedDict(reversed(list(values.items())))
    if kind == "list":
        return [values[k] for k in FIELDS]
    if kind == "tuple":
        return tuple(values[k] for k in FIELDS)
    if kind == "namedtuple":
        return Params(**values)
    if kind == "dataclass":
        return DataParams(**values)
    if kind == "attrs":
        with attrs.validators.disabled():  # expected results hold None where the validators want int/str
            return AttrsParams(**values)
    if kind == "nested":
        return {"outer": [DataParams(**values), (values["w"], "x")], "meta": None}
    raise AssertionError(kind)


def _read(kind: str, p: Any) -> dict:
    if kind in ("dict", "OrderedDict"):
        return p
    if kind in ("list", "tuple"):
        return dict(zip(FIELDS, p))
    if kind == "nested":
        inner = p["outer"][0]
        assert p["meta"] is None and p["outer"][1][1] == "x"
        return {k: getattr(inner, k) for k in FIELDS}
    return {k: getattr(p, k) for k in FIELDS}


CONTAINER_TYPES = {
    "dict": dict,
    "OrderedDict": collections.OrderedDict,
    "list": list,
    "tuple": tuple,
    "namedtuple": Params,
    "dataclass": DataParams,
    "attrs": AttrsParams,
    "nested": dict,
}


def _values(w, b) -> dict:
    return {"w": w, "b": b, "n": 3, "tag": "layer", "act": act, "on": True, "nothing": None}


def _expected_grad(kind: str, w: np.ndarray, b: np.ndarray, w2_grad=None) -> Any:
    n = 3
    none = {k: None for k in FIELDS}
    grads = {**none, "w": n * b * np.cos(w * b), "b": np.asarray(n * np.sum(w * np.cos(w * b)))}
    if kind == "nested":
        # the second copy of w in the tuple gets its own gradient; "x" and "meta" are None
        return {"outer": [DataParams(**grads), (w2_grad, None)], "meta": None}
    return _build(kind, grads)


BACKENDS = {
    "AutoJAX": (ad.AutoJAX(), lambda x: jnp.asarray(x, jnp.float32), dict(rtol=1e-5, atol=1e-6), "jax"),
    "AutoFiniteDifferences": (ad.AutoFiniteDifferences(), np.asarray, dict(rtol=1e-8, atol=1e-9), "numpy"),
}


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("kind", list(CONTAINER_TYPES))
def test_gradient_of_container_active(kind, backend, assert_tree_close, intact):
    b_obj, to, tol, framework = BACKENDS[backend]
    rng = np.random.default_rng(0)
    w, b = to(rng.uniform(-1, 1, 3)), to(np.asarray(rng.uniform(0.5, 1.5)))
    p = _build(kind, _values(w, b))
    seen = []

    def f(p):
        assert type(p) is CONTAINER_TYPES[kind]
        v = _read(kind, p)
        assert v["n"] == 3 and v["tag"] == "layer" and v["act"] is act and v["on"] is True and v["nothing"] is None
        seen.append(1)
        out = v["n"] * (jnp if isinstance(v["w"], jax.Array) else np).sum(v["act"](v["w"] * v["b"]))
        if kind == "nested":
            out = out + (p["outer"][1][0] ** 2).sum()  # the second copy of w: gradient 2 w
        return out

    with intact(p):
        g = ad.gradient(f, Active(p), backend=b_obj)
    assert seen
    w64, b64 = np.asarray(w, np.float64), np.asarray(b, np.float64)
    assert_tree_close(g, _expected_grad(kind, w64, b64, 2 * w64), **tol, framework=framework)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("kind", ["dict", "namedtuple", "dataclass", "attrs"])
def test_pushforward_and_hvp_take_tangents_in_the_container_layout(kind, backend, assert_tree_close, intact):
    """A tangent has the structure of the Active (None at non-floating leaves, like the gradient)."""
    b_obj, to, tol, framework = BACKENDS[backend]
    rng = np.random.default_rng(1)
    w, b = to(rng.uniform(-1, 1, 3)), to(np.asarray(rng.uniform(0.5, 1.5)))
    tw, tb = to(rng.normal(size=3)), to(np.asarray(rng.normal()))
    p = _build(kind, _values(w, b))
    tangent = _build(kind, {**{k: None for k in FIELDS}, "w": tw, "b": tb})

    def f(p):
        v = _read(kind, p)
        return v["n"] * (jnp if isinstance(v["w"], jax.Array) else np).sum(v["act"](v["w"] * v["b"]))

    w64, b64, tw64, tb64 = (np.asarray(a, np.float64) for a in (w, b, tw, tb))
    # grad_w = 3 b cos(wb), grad_b = 3 sum(w cos(wb))
    jvp = 3 * np.sum(b64 * np.cos(w64 * b64) * tw64) + 3 * np.sum(w64 * np.cos(w64 * b64)) * tb64
    hww = -3 * b64**2 * np.sin(w64 * b64)  # diagonal
    hwb = 3 * (np.cos(w64 * b64) - w64 * b64 * np.sin(w64 * b64))
    hbb = -3 * np.sum(w64**2 * np.sin(w64 * b64))
    hvp = {**{k: None for k in FIELDS}, "w": hww * tw64 + hwb * tb64, "b": np.asarray(hwb @ tw64 + hbb * tb64)}
    with intact(p, tangent):
        got_jvp = ad.pushforward(f, Active(p), tangent=tangent, backend=b_obj)
        got_hvp = ad.hvp(f, Active(p), tangent=tangent, backend=b_obj)
    assert_tree_close(got_jvp, np.asarray(jvp), **tol, framework=framework)
    assert_tree_close(got_hvp, _build(kind, hvp), **tol, framework=framework)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_jacobian_of_namedtuple_active_has_the_jax_layout(backend, assert_tree_close):
    b_obj, to, tol, framework = BACKENDS[backend]
    rng = np.random.default_rng(2)
    w, b = to(rng.uniform(-1, 1, 3)), to(np.asarray(rng.uniform(0.5, 1.5)))
    p = Params(w=w, b=b, n=3, tag="t", act=act, on=False, nothing=None)
    jac = ad.jacobian(lambda p: p.w * p.b, Active(p), backend=b_obj)
    w64, b64 = np.asarray(w, np.float64), np.asarray(b, np.float64)
    expected = Params(w=b64 * np.eye(3), b=w64, n=None, tag=None, act=None, on=None, nothing=None)
    assert_tree_close(jac, expected, **tol, framework=framework)


# ---------------------------------------------------------------------------- Equinox


def _sech2(z):
    return 1.0 - np.tanh(z) ** 2


@pytest.mark.parametrize("backend", ["AutoJAX", "AutoFiniteDifferences"])
def test_equinox_linear_active_analytic(backend, assert_tree_close, intact):
    b_obj = getattr(ad, backend)()
    model = eqx.nn.Linear(3, 2, key=jax.random.PRNGKey(0))
    v = jnp.asarray(np.random.default_rng(3).uniform(-1, 1, 3), jnp.float32)

    def loss(m, v):
        return jnp.sum(jnp.tanh(m(v)))

    with intact(model, v):
        g = ad.gradient(loss, Active(model), Constant(v), backend=b_obj)
    W, bias, v64 = (np.asarray(a, np.float64) for a in (model.weight, model.bias, v))
    s = _sech2(W @ v64 + bias)
    expected = eqx.tree_at(lambda m: (m.weight, m.bias), model, (np.outer(s, v64), s))
    tol = dict(rtol=1e-5, atol=1e-6) if backend == "AutoJAX" else dict(rtol=2e-6, atol=1e-7)  # float32 results
    assert_tree_close(g, expected, **tol, framework="jax", dtype=np.float32)


@pytest.mark.parametrize("backend", ["AutoJAX", "AutoFiniteDifferences"])
def test_equinox_mlp_active_against_filter_grad(backend, assert_tree_close, intact):
    """Callable fields (the activation) pass through as None, like eqx.filter_grad."""
    b_obj = getattr(ad, backend)()
    model = eqx.nn.MLP(2, 2, 3, 1, activation=jnp.tanh, key=jax.random.PRNGKey(1))
    v = jnp.asarray([0.3, -0.8], jnp.float32)

    def loss(m, v):
        return jnp.sum(jnp.sin(m(v)))

    with intact(model, v):
        g = ad.gradient(loss, Active(model), Constant(v), backend=b_obj)
    raw = eqx.filter_grad(loss)(model, v)  # a raw Equinox/JAX call, written here
    assert g.activation is None and g.final_activation is None
    assert_tree_close(g, raw, rtol=1e-5, atol=1e-6, framework="jax", dtype=np.float32)


# ============================================================================ the helpers check what they claim


class NT(NamedTuple):
    a: Any
    b: Any


HELPER_FAILURES = [
    ("value", np.array([1.0, 2.0]), np.array([1.0, 2.1]), "values differ"),
    ("longer", np.array([1.0, 2.0]), np.array([1.0, 2.0, 3.0]), "shape"),
    ("extra-axis", np.array([[1.0, 2.0]]), np.array([1.0, 2.0]), "shape"),
    ("dict-keys", {"a": np.ones(1)}, {"b": np.ones(1)}, "keys"),
    ("list-for-tuple", [np.ones(1)], (np.ones(1),), "expected a tuple"),
    ("namedtuple-for-tuple", NT(np.ones(1), None), (np.ones(1), None), "expected a tuple"),
    ("tuple-for-namedtuple", (np.ones(1), None), NT(np.ones(1), None), "expected a NT"),
    ("tuple-length", (np.ones(1),), (np.ones(1), np.ones(1)), "length"),
    ("array-for-None", {"a": np.ones(1), "b": np.ones(2)}, {"a": np.ones(1), "b": None}, "expected None"),
    ("None-for-array", {"a": np.ones(1), "b": None}, {"a": np.ones(1), "b": np.ones(2)}, "got None"),
    ("nan", np.array([np.nan]), np.array([1.0]), "values differ"),
    ("int-for-float", np.array([1, 2]), np.array([1.0, 2.0]), "floating"),
    ("str-for-array", "abc", np.ones(1), "expected an array"),
    ("nothing-compared", {"s": "x", "t": None}, {"s": "x", "t": None}, "compared no floating"),
    ("dataclass-static-field", DataParams(np.ones(1), np.ones(1), 1, "t", act, True, None),
     DataParams(np.ones(1), np.ones(1), 2, "t", act, True, None), "expected 2"),
]


@pytest.mark.parametrize("actual, expected, why", [pytest.param(*c[1:], id=c[0]) for c in HELPER_FAILURES])
def test_assert_tree_close_fails_when_it_should(actual, expected, why, assert_tree_close):
    with pytest.raises(AssertionError, match=why):
        assert_tree_close(actual, expected, rtol=1e-6, atol=1e-6)


def test_assert_tree_close_checks_framework_and_dtype(assert_tree_close):
    x = np.array([1.0, 2.0])
    assert_tree_close(jnp.asarray(x), x, rtol=1e-6, atol=0, framework="jax", dtype=np.float32)
    assert_tree_close(x, jnp.asarray(x), rtol=1e-6, atol=0, framework="numpy", dtype=np.float64)
    with pytest.raises(AssertionError, match="expected a jax array"):
        assert_tree_close(x, x, rtol=1e-6, atol=0, framework="jax")
    with pytest.raises(AssertionError, match="expected a numpy array"):
        assert_tree_close(jnp.asarray(x), x, rtol=1e-6, atol=0, framework="numpy")
    with pytest.raises(AssertionError, match="expected dtype float64"):
        assert_tree_close(x.astype(np.float32), x, rtol=1e-6, atol=0, dtype=np.float64)


def test_assert_tree_close_passes_on_equal_trees_within_tolerance(assert_tree_close):
    tree = {"a": (np.ones(2), None, "s"), "b": [NT(np.zeros(3), 2.0)], "c": DataParams(np.ones(1), None, 1, "t", act, True, None)}
    close = {"a": (np.ones(2) + 1e-9, None, "s"), "b": [NT(np.zeros(3), 2.0)], "c": DataParams(np.ones(1), None, 1, "t", act, True, None)}
    assert_tree_close(close, tree, rtol=1e-8, atol=1e-8)
    with pytest.raises(AssertionError, match=r"\['a'\]\[0\]"):  # the failing path is named
        assert_tree_close(close, tree, rtol=1e-12, atol=0)


def _mutations():
    def setitem(t):
        t["a"][0] = 5.0

    def add_key(t):
        t["new"] = 1

    def append(t):
        t["l"].append(2)

    def rebind_field(t):
        t["d"].n = 4

    def replace_array(t):
        t["l"][0] = np.zeros(2)

    def dtype_view(t):
        t["d"].w = t["d"].w.astype(np.float32)

    def rewrite_same_values(t):
        t["a"][...] = t["a"].copy()  # bitwise the same, NaN included: must pass

    return [setitem, add_key, append, rebind_field, replace_array, dtype_view], rewrite_same_values


@pytest.mark.parametrize("mutate", _mutations()[0], ids=lambda m: m.__name__)
def test_intact_detects_every_mutation(mutate, intact):
    tree = {"a": np.ones(3), "l": [np.ones(2)], "d": DataParams(np.ones(2), 1.0, 3, "t", act, True, None)}
    with pytest.raises(AssertionError, match="modified"):
        with intact(tree):
            mutate(tree)


def test_intact_passes_when_nothing_changed(intact):
    tree = {"a": np.array([1.0, np.nan]), "j": jnp.ones(2), "l": [np.ones(2), "s", None]}
    with intact(tree):
        _mutations()[1](tree)


class _Pair(NamedTuple):
    first: Any
    second: Any


class _Checked(collections.namedtuple("_Checked", "value mask")):
    """A namedtuple whose constructor refuses None, as torch's PackedSequence does."""

    def __new__(cls, value, mask):
        if value is None:
            raise TypeError("value must be given")
        return super().__new__(cls, value, mask)


_REBUILT_STRUCTURES = {
    "dict in insertion order": lambda a, b, c: {"w1": a, "b1": b, "w2": c},
    "mask with None": lambda a, b, c: {"body": [(None, None), (a, None)], "head": {"w": b, "b": c}},
    "nested lists and tuples": lambda a, b, c: [a, (b,), {"z": [c, None], "a": ()}],
    "odd keys": lambda a, b, c: {"it's": a, 3: b, (1, "x"): c, None: []},
    "namedtuple": lambda a, b, c: _Pair(a, {"x": (b, c)}),
    "validating namedtuple": lambda a, b, c: [_Checked(a, None), b, c],
    "ordered and default dicts": lambda a, b, c: [collections.OrderedDict(b=a, a=b), collections.defaultdict(int, k=c)],
}


def _layout(tree, containers):
    """``tree`` drawn with its container types, key order and the identity of each array."""
    if isinstance(tree, np.ndarray):
        return f"array@{id(tree)}"
    if tree is None:
        return "None"
    containers.append(tree)
    if isinstance(tree, dict):
        return f"{type(tree).__name__}{{" + ", ".join(f"{k!r}: {_layout(v, containers)}" for k, v in tree.items()) + "}"
    return f"{type(tree).__name__}(" + ", ".join(_layout(v, containers) for v in tree) + ")"


@pytest.mark.parametrize("build", _REBUILT_STRUCTURES.values(), ids=_REBUILT_STRUCTURES.keys())
def test_rebuilder_builds_the_structure_with_each_leaf_in_its_place(build):
    from activity._tree import flatten, rebuilder

    leaves, spec = flatten(build("a", "b", "c"))
    arrays = [np.full(2, float(index)) for index in range(len(leaves))]
    want = build(*(arrays[leaves.index(name)] for name in "abc"))
    rebuild = rebuilder(spec)
    first, second = [], []
    assert _layout(rebuild(arrays), first) == _layout(want, [])
    _layout(rebuild(arrays), second)  # each call builds its own containers: a caller may change them
    assert not {id(c) for c in first if isinstance(c, (list, dict))} & {id(c) for c in second if isinstance(c, (list, dict))}


def test_static_values_are_the_same_signature_by_type_and_value():
    """One comparison of static values serves a node's aux data, a torch node's context and a
    compiled-in leaf: the same type and equal, containers item by item, arrays elementwise."""
    from activity._tree import same_static_value

    class NoBoolEquality:
        def __eq__(self, other):
            return np.array([True, False])

    thing = NoBoolEquality()
    assert same_static_value("relu", "relu") and same_static_value((1, "a"), (1, "a"))
    assert not same_static_value(2, 2.0) and not same_static_value(1, True) and not same_static_value((1,), (True,))
    assert same_static_value([np.arange(3)], [np.arange(3)]) and not same_static_value([np.arange(3)], [np.arange(3) + 1])
    assert not same_static_value(np.arange(3), np.arange(3).astype(np.float32))
    assert same_static_value(thing, thing) and not same_static_value(thing, NoBoolEquality())

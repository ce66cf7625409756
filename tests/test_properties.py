"""Property-based tests: random pytrees, shapes, dtypes and annotation mixes.

Every expected value here is computed ANALYTICALLY in numpy float64 from the
inputs, never with the library.

- gradient: every backend (AutoJAX on JAX arrays, AutoTorch on torch tensors,
  AutoFiniteDifferences on all three) agrees with the analytic gradient of
  ``f = (K + m/2) * sum_i w_i * sum(tanh(x_i)**2)``, where ``x_i`` are the
  Active float leaves, ``K = 1 + 0.1 * sum_j sum(tanh(c_j))`` over the
  Constant float leaves, and ``m`` counts the non-empty Cache float leaves,
  into each of which f writes its running sum and reads it back. The result
  has the Active's structure: same container types, ``None`` at every
  non-float leaf, leaves of the input's framework, shape and dtype.
- pushforward / pullback of ``out = {"leaves": [K*(w_i x_i + 0.1 x_i**2)],
  "s": K * sum_i sum(v_i x_i)}`` agree with the analytic JVP / VJP.
- every INVALID draw raises a clean ``TypeError``/``ValueError``/
  ``activity.UnsupportedError`` with a message from activity (never an
  AttributeError, IndexError, KeyError or RuntimeError from inside).

Draws: nested dict/list/tuple of depth <= 3; float leaves of shape with sizes
0-3 (0-d and empty arrays included), float32/float64 (float32 only for JAX);
odd leaves: Python ints, integer arrays, None, strings; at most 12 float
entries in all so finite differences stay fast.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import activity as ad
from activity import Active, Cache, Constant

J = ad.AutoJAX()
T = ad.AutoTorch()
FD = ad.AutoFiniteDifferences()

FRAMEWORKS = ["numpy", "torch", "jax"]
BACKENDS = {"numpy": [FD], "torch": [T, FD], "jax": [J, FD]}
DTYPES = {"numpy": ["float32", "float64"], "torch": ["float32", "float64"], "jax": ["float32"]}
MAX_FLOAT_ENTRIES = 12

SETTINGS = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)

# ============================================================================ blueprints
#
# A blueprint is a framework-free description of a tree: dict / list / tuple
# nodes, and leaves ("float", shape, dtype), ("int",), ("intarray", n),
# ("none",), ("str",). `materialize` turns it into numpy, torch or JAX values.


def shapes(min_side: int) -> st.SearchStrategy:
    return st.lists(st.integers(min_side, 3), max_size=2).map(tuple)


def float_leaves(framework: str, min_side: int = 0) -> st.SearchStrategy:
    return st.tuples(st.just("float"), shapes(min_side), st.sampled_from(DTYPES[framework]))


ODD_LEAVES = st.one_of(
    st.just(("int",)),
    st.just(("none",)),
    st.just(("str",)),
    st.integers(0, 2).map(lambda n: ("intarray", n)),
)


def trees(leaf: st.SearchStrategy, depth: int = 3) -> st.SearchStrategy:
    if depth == 0:
        return leaf
    child = trees(leaf, depth - 1)
    return st.one_of(
        leaf,
        st.lists(child, max_size=3),
        st.lists(child, max_size=3).map(tuple),
        st.dictionaries(st.sampled_from("abcd"), child, max_size=3),
    )


def leaves_of(blueprint: Any, path: tuple = ()) -> list[tuple[tuple, tuple]]:
    """(path, leaf) for every leaf of a blueprint, in a fixed order."""
    if isinstance(blueprint, dict):
        return [item for key in sorted(blueprint) for item in leaves_of(blueprint[key], (*path, key))]
    if isinstance(blueprint, list | tuple) and not (blueprint and isinstance(blueprint[0], str)):
        return [item for i, child in enumerate(blueprint) for item in leaves_of(child, (*path, i))]
    return [(path, blueprint)]


def is_leaf_blueprint(node: Any) -> bool:
    return isinstance(node, tuple) and bool(node) and isinstance(node[0], str)


def float_size(blueprint: Any) -> int:
    return sum(math.prod(leaf[1]) for _, leaf in leaves_of(blueprint) if leaf[0] == "float")


def has_float(blueprint: Any) -> bool:
    return any(leaf[0] == "float" for _, leaf in leaves_of(blueprint))


def materialize(blueprint: Any, framework: str, rng: np.random.Generator) -> Any:
    if is_leaf_blueprint(blueprint):
        kind = blueprint[0]
        if kind == "float":
            value = rng.uniform(-1.5, 1.5, size=blueprint[1]).astype(blueprint[2])
            return to_framework(value, framework)
        if kind == "intarray":
            return to_framework(np.arange(blueprint[1]), framework)
        return {"int": 3, "none": None, "str": "text"}[kind]
    if isinstance(blueprint, dict):
        return {key: materialize(child, framework, rng) for key, child in blueprint.items()}
    children = [materialize(child, framework, rng) for child in blueprint]
    return tuple(children) if isinstance(blueprint, tuple) else children


def to_framework(value: np.ndarray, framework: str) -> Any:
    if framework == "torch":
        return torch.from_numpy(np.array(value))
    if framework == "jax":
        return jnp.asarray(value)
    return np.array(value)


# ============================================================================ value trees


def is_float_array(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return x.dtype.is_floating_point
    if isinstance(x, jax.Array | np.ndarray | np.generic):
        return np.dtype(x.dtype).kind == "f"
    return False


def float_items(tree: Any, path: tuple = ()) -> list[tuple[tuple, Any]]:
    """(path, leaf) for the float arrays of a value tree, in the blueprint order."""
    if isinstance(tree, dict):
        return [item for key in sorted(tree) for item in float_items(tree[key], (*path, key))]
    if isinstance(tree, list | tuple):
        return [item for i, child in enumerate(tree) for item in float_items(child, (*path, i))]
    return [(path, tree)] if is_float_array(tree) else []


def map_leaves(tree: Any, fn, path: tuple = ()) -> Any:
    """``tree`` with every leaf (None included) replaced by ``fn(path, leaf)``."""
    if isinstance(tree, dict):
        return {key: map_leaves(child, fn, (*path, key)) for key, child in tree.items()}
    if isinstance(tree, list | tuple):
        children = [map_leaves(child, fn, (*path, i)) for i, child in enumerate(tree)]
        return tuple(children) if isinstance(tree, tuple) else children
    return fn(path, tree)


def to_np64(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy().astype(np.float64)
    return np.asarray(x, dtype=np.float64)


def xp_of(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch
    if isinstance(x, jax.Array):
        return jnp
    return np


def weight(position: int, path: tuple) -> float:
    return 0.5 + 0.25 * ((position + len(path) + sum(ord(ch) for ch in str(path)) % 5) % 4)


def direction(position: int, path: tuple, shape: tuple) -> np.ndarray:
    """A fixed float64 array v_i for the mixing output of the linear-ish function."""
    n = math.prod(shape)
    return np.cos(np.arange(n) + 1.0 + position + len(path)).reshape(shape)


# ============================================================================ draws


@st.composite
def valid_problems(draw, framework: str, active_size_zero_ok: bool = True) -> dict:
    """1-3 annotated arguments with at least one Active holding a float leaf.

    With ``active_size_zero_ok=False``, draws whose Active float leaves are all
    empty (total size 0) are left out (see the edge-case tests at the end).
    """
    n_args = draw(st.integers(1, 3))
    kinds = draw(st.lists(st.sampled_from(["active", "constant", "cache"]), min_size=n_args, max_size=n_args))
    if "active" not in kinds:
        kinds[draw(st.integers(0, n_args - 1))] = "active"
    blueprints = []
    for kind in kinds:
        if kind == "cache":
            leaf = float_leaves(framework)
        else:
            leaf = st.one_of(float_leaves(framework), float_leaves(framework), ODD_LEAVES)
        bp = draw(trees(leaf))
        if kind == "active" and not has_float(bp):
            bp = [bp, draw(float_leaves(framework))]
        blueprints.append(bp)
    assume(sum(float_size(bp) for bp in blueprints) <= MAX_FLOAT_ENTRIES)
    if not active_size_zero_ok:
        assume(sum(float_size(bp) for bp, kind in zip(blueprints, kinds) if kind == "active") > 0)
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    values = [materialize(bp, framework, rng) for bp in blueprints]
    return {"kinds": kinds, "blueprints": blueprints, "values": values, "framework": framework}


def annotate(kinds: list[str], values: list[Any]) -> list:
    wrap = {"active": Active, "constant": Constant, "cache": Cache}
    return [wrap[kind](value) for kind, value in zip(kinds, values)]


def constant_factor(kinds: list[str], values: list[Any]) -> float:
    k = 1.0
    for kind, value in zip(kinds, values):
        if kind == "constant":
            for _, leaf in float_items(value):
                k += 0.1 * float(np.tanh(to_np64(leaf)).sum())
    return k


# ============================================================================ f and analytic results


def make_scalar_f(kinds: list[str]):
    """f = K*S + sum over non-empty Cache float leaves of mean(c) / 2, after writing S into c."""

    def f(*values):
        s = None
        k = 1.0
        for position, (kind, value) in enumerate(zip(kinds, values)):
            for path, leaf in float_items(value):
                xp = xp_of(leaf)
                if kind == "active":
                    term = weight(position, path) * (xp.tanh(leaf) ** 2).sum()
                    s = term if s is None else s + term
                elif kind == "constant":
                    k = k + 0.1 * xp.tanh(leaf).sum()
        total = k * s
        for kind, value in zip(kinds, values):
            if kind != "cache":
                continue
            for _, c in float_items(value):
                n = math.prod(tuple(c.shape))
                if n == 0:
                    continue
                if isinstance(c, jax.Array):
                    c = c.at[...].set(s)
                elif isinstance(c, torch.Tensor):
                    c[...] = s.to(c.dtype)
                else:
                    c[...] = s
                total = total + 0.5 * c.sum() / n
        return total

    return f


def analytic_gradient(problem: dict) -> Any:
    kinds, values = problem["kinds"], problem["values"]
    m = sum(
        1
        for kind, value in zip(kinds, values)
        if kind == "cache"
        for _, c in float_items(value)
        if math.prod(tuple(c.shape)) > 0
    )
    factor = constant_factor(kinds, values) + 0.5 * m

    def grad_leaf(position):
        def fn(path, leaf):
            if not is_float_array(leaf):
                return None
            t = np.tanh(to_np64(leaf))
            return factor * weight(position, path) * 2 * t * (1 - t**2)

        return fn

    grads = [map_leaves(value, grad_leaf(p)) for p, (kind, value) in enumerate(zip(kinds, values)) if kind == "active"]
    return grads[0] if len(grads) == 1 else tuple(grads)


def make_linear_f(kinds: list[str]):
    """out = {"leaves": [K*(w_i x_i + 0.1 x_i**2)], "s": K * sum_i sum(v_i x_i)}."""

    def f(*values):
        k = 1.0
        for kind, value in zip(kinds, values):
            if kind == "constant":
                for _, leaf in float_items(value):
                    k = k + 0.1 * xp_of(leaf).tanh(leaf).sum()
        outs, s = [], None
        for position, (kind, value) in enumerate(zip(kinds, values)):
            if kind != "active":
                continue
            for path, x in float_items(value):
                outs.append(k * (weight(position, path) * x + 0.1 * x**2))
                v = direction(position, path, tuple(x.shape))
                v = torch.as_tensor(v, dtype=x.dtype) if isinstance(x, torch.Tensor) else xp_of(x).asarray(v, dtype=x.dtype)
                term = (v * x).sum()
                s = term if s is None else s + term
        return {"leaves": outs, "s": k * s}

    return f


def active_items(problem: dict) -> list[tuple[int, tuple, np.ndarray]]:
    return [
        (position, path, to_np64(x))
        for position, (kind, value) in enumerate(zip(problem["kinds"], problem["values"]))
        if kind == "active"
        for path, x in float_items(value)
    ]


def random_like_active(problem: dict, rng: np.random.Generator) -> Any:
    """A tangent: the Active structure, None at non-float leaves, random floats of each leaf's dtype."""

    def fn(path, leaf):
        if not is_float_array(leaf):
            return None
        arr = rng.uniform(-1, 1, size=tuple(leaf.shape)).astype(str(leaf.dtype).replace("torch.", ""))
        return to_framework(arr, problem["framework"])

    parts = [map_leaves(v, fn) for k, v in zip(problem["kinds"], problem["values"]) if k == "active"]
    return parts[0] if len(parts) == 1 else tuple(parts)


def flat_tangent(problem: dict, tangent: Any) -> list[np.ndarray]:
    parts = (tangent,) if problem["kinds"].count("active") == 1 else tangent
    return [to_np64(t) for part in parts for _, t in float_items(part)]


# ============================================================================ comparison


def assert_result_like(actual: Any, expected: Any, inputs: Any, framework: str, rtol: float, atol: float, where: str = "") -> None:
    """Same containers, None where expected is None, framework/shape/dtype of the input, values close."""
    if isinstance(expected, dict):
        assert type(actual) is dict and sorted(actual) == sorted(expected), f"{where}: {actual!r} vs keys {sorted(expected)}"
        for key in expected:
            assert_result_like(actual[key], expected[key], inputs[key], framework, rtol, atol, f"{where}[{key!r}]")
        return
    if isinstance(expected, list | tuple):
        assert type(actual) is type(expected) and len(actual) == len(expected), f"{where}: {type(actual).__name__} vs {type(expected).__name__}"
        for i, (a, e, x) in enumerate(zip(actual, expected, inputs)):
            assert_result_like(a, e, x, framework, rtol, atol, f"{where}[{i}]")
        return
    if expected is None:
        assert actual is None, f"{where}: expected None at a non-float leaf, got {actual!r}"
        return
    kind = {"torch": torch.Tensor, "jax": jax.Array, "numpy": np.ndarray | np.generic}[framework]
    assert isinstance(actual, kind), f"{where}: expected a {framework} array, got {type(actual).__name__}"
    assert tuple(actual.shape) == tuple(inputs.shape), f"{where}: shape {tuple(actual.shape)} vs {tuple(inputs.shape)}"
    assert str(actual.dtype) == str(inputs.dtype), f"{where}: dtype {actual.dtype} vs {inputs.dtype}"
    np.testing.assert_allclose(to_np64(actual), expected, rtol=rtol, atol=atol, err_msg=where)


def tolerances(backend) -> tuple[float, float]:
    return (2e-4, 2e-5)


def active_inputs(problem: dict) -> Any:
    parts = [v for k, v in zip(problem["kinds"], problem["values"]) if k == "active"]
    return parts[0] if len(parts) == 1 else tuple(parts)


def snapshot(values: list) -> list:
    return [map_leaves(v, lambda p, x: to_np64(x).tobytes() if is_float_array(x) else repr(x)) for v in values]


# ============================================================================ (a) gradient


@pytest.mark.parametrize("active_size_zero_ok", [True, False], ids=["any-active-size", "active-size-above-0"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
@SETTINGS
@given(data=st.data())
def test_gradient_matches_the_analytic_gradient(framework, active_size_zero_ok, data):
    problem = data.draw(valid_problems(framework, active_size_zero_ok))
    f = make_scalar_f(problem["kinds"])
    expected = analytic_gradient(problem)
    inputs = active_inputs(problem)
    for backend in BACKENDS[framework]:
        non_cache = [v for k, v in zip(problem["kinds"], problem["values"]) if k != "cache"]
        before = snapshot(non_cache)
        result = ad.gradient(f, *annotate(problem["kinds"], problem["values"]), backend=backend)
        rtol, atol = tolerances(backend)
        assert_result_like(result, expected, inputs, framework, rtol, atol, repr(backend))
        assert snapshot(non_cache) == before, f"{backend!r} changed an Active or Constant value"


# ============================================================================ (b) pushforward / pullback


@pytest.mark.parametrize("active_size_zero_ok", [True, False], ids=["any-active-size", "active-size-above-0"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
@SETTINGS
@given(data=st.data())
def test_pushforward_and_pullback_match_the_analytic_jacobian_products(framework, active_size_zero_ok, data):
    problem = data.draw(valid_problems(framework, active_size_zero_ok))
    kinds, values = problem["kinds"], problem["values"]
    f = make_linear_f(kinds)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    k = constant_factor(kinds, values)
    items = active_items(problem)
    tangent = random_like_active(problem, rng)
    ts = flat_tangent(problem, tangent)
    jvp_leaves = [k * (weight(p, path) + 0.2 * x) * t for (p, path, x), t in zip(items, ts)]
    jvp_s = k * sum(float((direction(p, path, x.shape) * t).sum()) for (p, path, x), t in zip(items, ts))

    out_dtypes = [str(x.dtype) for p, (kd, v) in enumerate(zip(kinds, values)) if kd == "active" for _, x in float_items(v)]
    cts = [rng.uniform(-1, 1, size=x.shape) for _, _, x in items]
    ct_s = float(rng.uniform(-1, 1))
    like = lambda arr, dtype: to_framework(np.asarray(arr).astype(dtype.replace("torch.", "")), framework)  # noqa: E731
    s_dtype = out_dtypes[0].replace("torch.", "")
    cotangent = {"leaves": [like(c, d) for c, d in zip(cts, out_dtypes)], "s": like(np.asarray(ct_s), s_dtype)}

    def vjp_leaf(position):
        lookup = {(p, path): (x, c) for (p, path, x), c in zip(items, cts)}

        def fn(path, leaf):
            if not is_float_array(leaf):
                return None
            x, c = lookup[(position, path)]
            return k * ((weight(position, path) + 0.2 * x) * c + direction(position, path, x.shape) * ct_s)

        return fn

    vjp = [map_leaves(v, vjp_leaf(p)) for p, (kd, v) in enumerate(zip(kinds, values)) if kd == "active"]
    vjp = vjp[0] if len(vjp) == 1 else tuple(vjp)
    inputs = active_inputs(problem)

    for backend in BACKENDS[framework]:
        rtol, atol = tolerances(backend)
        out = ad.pushforward(f, *annotate(kinds, values), tangent=tangent, backend=backend)
        assert sorted(out) == ["leaves", "s"] and len(out["leaves"]) == len(jvp_leaves), repr(backend)
        for i, (a, e) in enumerate(zip(out["leaves"], jvp_leaves)):
            np.testing.assert_allclose(to_np64(a), e, rtol=rtol, atol=atol, err_msg=f"{backend!r} leaves[{i}]")
        np.testing.assert_allclose(to_np64(out["s"]), jvp_s, rtol=rtol, atol=atol, err_msg=f"{backend!r} s")

        result = ad.pullback(f, *annotate(kinds, values), cotangent=cotangent, backend=backend)
        assert_result_like(result, vjp, inputs, framework, rtol, atol, f"{backend!r} pullback")


# ============================================================================ (c) invalid draws


CLEAN = (TypeError, ValueError, ad.UnsupportedError)


def assert_clean_error(call) -> BaseException:
    try:
        call()
    except CLEAN as error:
        assert type(error) not in (AttributeError, IndexError, KeyError, RuntimeError)
        assert "activity" in str(error), f"not a message from activity: {type(error).__name__}: {error}"
        return error
    except Exception as error:  # noqa: BLE001
        pytest.fail(f"unclean error {type(error).__name__}: {error}")
    pytest.fail("no error raised for an invalid call")


@st.composite
def invalid_calls(draw, framework: str):
    """A valid problem, then one mistake: (description, call)."""
    problem = draw(valid_problems(framework))
    kinds, values = list(problem["kinds"]), list(problem["values"])
    f = make_scalar_f(kinds)
    args = annotate(kinds, values)
    backend = draw(st.sampled_from(BACKENDS[framework]))
    mistake = draw(st.sampled_from(["active-without-float", "unannotated", "cache-with-str", "tangent-structure", "tangent-shape"]))
    position = draw(st.sampled_from([i for i, k in enumerate(kinds) if k == "active"]))
    rng = np.random.default_rng(0)
    if mistake == "active-without-float":
        bp = draw(trees(ODD_LEAVES, 2))
        args[position] = Active(materialize(bp, framework, rng))
        return mistake, lambda: ad.gradient(f, *args, backend=backend)
    if mistake == "unannotated":
        index = draw(st.integers(0, len(args) - 1))
        args[index] = values[index]
        return mistake, lambda: ad.gradient(f, *args, backend=backend)
    if mistake == "cache-with-str":
        bp = draw(trees(float_leaves(framework), 2))
        cache = materialize(bp, framework, rng)
        cache = {"buffers": cache, "name": "scratch"}
        return mistake, lambda: ad.gradient(f, *args, Cache(cache), backend=backend)
    tangent = random_like_active(problem, rng)
    n_active = kinds.count("active")
    if mistake == "tangent-structure":
        how = draw(st.sampled_from(["wrap-in-list", "wrap-in-dict", "drop"]))
        if how == "wrap-in-list":
            tangent = [tangent]
        elif how == "wrap-in-dict":
            tangent = {"extra": tangent}
        else:
            tangent = tangent[:-1] if n_active > 1 else "not a tangent"
    else:  # one float leaf of the tangent gets one more entry
        bumped = []

        def bump(path, leaf):
            if leaf is None or bumped:
                return leaf
            bumped.append(path)
            arr = np.concatenate([to_np64(leaf).reshape(-1), [1.0]]).astype(np.float32)
            return to_framework(arr, framework)

        parts = [tangent] if n_active == 1 else list(tangent)
        parts = [map_leaves(part, bump) for part in parts]
        tangent = parts[0] if n_active == 1 else tuple(parts)
    g = make_linear_f(kinds)
    return mistake, lambda: ad.pushforward(g, *args, tangent=tangent, backend=backend)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_invalid_draws_raise_clean_errors(framework, data):
    mistake, call = data.draw(invalid_calls(framework))
    error = assert_clean_error(call)
    expected = {
        "active-without-float": (TypeError, r"Active but holds no floating-point value.*Constant"),
        "unannotated": (TypeError, r"unannotated.*Active\(x\).*Constant\(x\).*Cache\(x\)"),
        "cache-with-str": (TypeError, r"Cache holding a str at \['name'\]"),
        "tangent-structure": (ValueError, r"tangent"),
        "tangent-shape": (ValueError, r"tangent.*has shape .*expected"),
    }[mistake]
    assert isinstance(error, expected[0]), f"{mistake}: {type(error).__name__}: {error}"
    import re

    assert re.search(expected[1], str(error), re.DOTALL), f"{mistake}: {error}"


# ============================================================================ edge cases found by the properties
#
# Each is the minimal form of a draw above; kept as plain tests so the failure
# is readable without hypothesis.


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_finite_differences_gradient_when_every_active_leaf_is_empty(framework):
    x = to_framework(np.ones(0), framework) if framework != "jax" else jnp.ones(0)
    result = ad.gradient(lambda a: (a**2).sum() + 1.0, Active(x), backend=FD)
    assert tuple(result.shape) == (0,)


@pytest.mark.parametrize("framework, backend", [("torch", T), ("numpy", FD), ("jax", J), ("jax", FD)], ids=["AutoTorch", "FD-numpy", "AutoJAX", "FD-jax"])
def test_jacobian_with_an_empty_output(framework, backend):
    x = to_framework(np.ones(2, np.float32), framework)
    result = ad.jacobian(lambda a: a[:0] * 2, Active(x), backend=backend)
    assert tuple(result.shape) == (0, 2)


@pytest.mark.parametrize("framework, backend", [("torch", T), ("jax", J), ("numpy", FD), ("torch", FD)], ids=["AutoTorch", "AutoJAX", "FD-numpy", "FD-torch"])
def test_f_returning_a_constant_python_float_is_not_a_crash(framework, backend):
    """The output does not depend on x: a zero gradient (as AutoJAX gives), or a clean error."""
    x = to_framework(np.ones(3, np.float32), framework)
    try:
        result = ad.gradient(lambda a: 1.0, Active(x), backend=backend)
    except CLEAN as error:
        assert "activity" in str(error), f"{type(error).__name__}: {error}"
        return
    np.testing.assert_array_equal(to_np64(result), np.zeros(3))

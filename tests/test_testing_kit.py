"""The testing kit, tested like a product.

- `assert_tree_allclose` on hand-made trees: passes when close, fails naming
  exactly the mismatching paths, refuses structure differences and vacuous
  passes, honours ``ignore=`` and the tolerance formula at its boundary.
- Deliberately broken backends (one derivative leaf off by 1%, mutated
  arguments, a consumed global RNG, stale prepared results) are caught on
  every scenario type.
- The full catalogues pass on AutoTorch and AutoJAX against the finite
  difference reference; other frameworks' scenarios show as not applicable (n/a).
- Every transform keeps the expected result, and the reference really
  reaches it on the transformed scenario.
- `Scenario`, `test_differentiation.__test__`, explicit catalogue seeds.

Finite-difference references are computed once per scenario: the scenario
lists are module-scoped fixtures and `Scenario` caches its reference result.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import attrs
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import activity as ad
from activity import Active, Constant
from activity.testing import (
    Scenario,
    assert_tree_allclose,
    batchify,
    cachify,
    closurify,
    constantify,
    default_scenarios,
    nn_scenarios,
    test_differentiation,  # must not be collected by pytest (``__test__ = False``)
)

OPERATORS = {
    "derivative",
    "value_and_derivative",
    "second_derivative",
    "value_derivative_and_second_derivative",
    "gradient",
    "value_and_gradient",
    "jacobian",
    "value_and_jacobian",
    "pushforward",
    "value_and_pushforward",
    "pullback",
    "value_and_pullback",
    "hessian",
    "value_gradient_and_hessian",
    "hvp",
    "gradient_and_hvp",
}
SEEDED = {"pushforward", "value_and_pushforward", "pullback", "value_and_pullback", "hvp", "gradient_and_hvp"}
VALUE_FIRST = {"value_and_pushforward", "value_and_pullback", "gradient_and_hvp"}

# Scenario names are the same in every framework; numpy needs no framework import at collection.
DEFAULT_NAMES = [s.name for s in default_scenarios("numpy")]
NN_SAMPLE = {
    "torch": ["linear", "conv2d", "maxout", "batchnorm1d_train", "multihead_attention", "lstm", "gru", "embedding"],
    "jax": [
        "linear",
        "conv2d",
        "batchnorm_train",
        "multihead_attention",
        "lstm_cell_unrolled",
        "gru_scan",
        "embedding",
    ],
}


def compare(actual: Any, expected: Any, **kw: Any) -> int:
    kw.setdefault("rtol", 1e-6)
    kw.setdefault("atol", 0.0)
    return assert_tree_allclose(actual, expected, **kw)


def failure(actual: Any, expected: Any, **kw: Any) -> str:
    """The message of the AssertionError ``compare`` must raise."""
    with pytest.raises(AssertionError) as info:
        compare(actual, expected, **kw)
    return str(info.value)


def failing_paths(message: str) -> list[str]:
    """The paths listed as mismatching in an assert_tree_allclose message (lines ``  <path>: ...``)."""
    return [m.group(1) for m in re.finditer(r"^  (\S.*?): ", message, flags=re.MULTILINE)]


def first_per_operator(scenarios: list[Scenario]) -> list[Scenario]:
    """One scenario per operator (the first, usually the smallest): cheaper subsets that still cover every operator."""
    seen: dict[str, Scenario] = {}
    for s in scenarios:
        seen.setdefault(s.op, s)
    return list(seen.values())


# ============================================================================ fixtures


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    # torch's intra-op thread pool on a busy 2-core machine makes tiny ops (a float64 LSTM step)
    # hundreds of times slower; the finite-difference references call f thousands of times.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def default_numpy() -> list[Scenario]:
    return default_scenarios("numpy")


@pytest.fixture(scope="module")
def default_torch() -> list[Scenario]:
    return default_scenarios("torch")


@pytest.fixture(scope="module")
def default_jax() -> list[Scenario]:
    return default_scenarios("jax")


@pytest.fixture(scope="module")
def nn_torch() -> list[Scenario]:
    return nn_scenarios("torch")


@pytest.fixture(scope="module")
def nn_jax() -> list[Scenario]:
    return nn_scenarios("jax")


def by_name(scenarios: list[Scenario]) -> dict[str, Scenario]:
    names = [s.name for s in scenarios]
    assert len(set(names)) == len(names), "scenario names must be unique"
    return dict(zip(names, scenarios))


# ============================================================================ 1. assert_tree_allclose

Pair = collections.namedtuple("Pair", "w b")


@dataclasses.dataclass
class DataLayer:
    weight: np.ndarray
    bias: float


@attrs.frozen
class AttrsLayer:
    weight: np.ndarray
    scale: float
    name: str


def torch_named_parameters(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = {"0.weight": (3, 2), "0.bias": (3,), "2.weight": (1, 3), "2.bias": (1,)}
    return {name: torch.randn(*shape, generator=generator) for name, shape in shapes.items()}


def eqx_mlp() -> eqx.nn.MLP:
    return eqx.nn.MLP(2, 2, 3, 2, key=jax.random.PRNGKey(0))


def bump(tree: Any, where: Callable, factor: float = 1.01) -> Any:
    return eqx.tree_at(where, tree, where(tree) * factor)


def close_trees() -> dict[str, tuple[Any, Any]]:
    """(actual, expected) pairs that agree to within 1e-9 relative."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4))
    params = torch_named_parameters()
    mlp = eqx_mlp()
    return {
        "dict": ({"a": x, "b": 2.0}, {"a": x * (1 + 1e-9), "b": 2.0}),
        "nested_lists_tuples": ({"a": [x, (x[0], [x[1]])]}, {"a": [x + 1e-12, (x[0], [x[1]])]}),
        "namedtuple": (Pair(x, 1.0), Pair(x.copy(), 1.0 + 1e-12)),
        "dataclass": (DataLayer(x, 0.5), DataLayer(x.copy(), 0.5)),
        "attrs": (AttrsLayer(x, 2.0, "dense"), AttrsLayer(x.copy(), 2.0, "dense")),
        "equinox_module": (mlp, bump(mlp, lambda m: m.layers[1].weight, 1 + 1e-9)),
        "torch_named_parameters": (params, {k: v.clone() for k, v in params.items()}),
        "jax_arrays": ({"w": jnp.arange(6.0).reshape(2, 3)}, {"w": jnp.arange(6.0).reshape(2, 3)}),
        "mixed_frameworks_none_and_ints": (
            {"t": torch.ones(2), "j": jnp.ones(2), "n": None, "k": 3, "s": "name"},
            {"t": torch.ones(2), "j": jnp.ones(2), "n": None, "k": 3, "s": "name"},
        ),
        "scalar_root": (np.float64(1.0), 1.0),
    }


@pytest.mark.parametrize("case", list(close_trees()))
def test_allclose_passes_on_close_trees(case):
    actual, expected = close_trees()[case]
    assert compare(actual, expected) >= 1


def mismatching_trees() -> dict[str, tuple[Any, Any, list[str]]]:
    """(actual, expected, exactly the paths that must be named)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4))
    params = torch_named_parameters()
    off_params = dict(params, **{"0.weight": params["0.weight"] * 1.01})
    mlp = eqx_mlp()
    return {
        "dict_in_list": ({"a": [x, x + 1], "b": x}, {"a": [x, x], "b": x}, ["['a'][1]"]),
        "two_paths": ({"a": [x, x + 1], "b": x, "c": 1.0}, {"a": [x, x], "b": x * 2, "c": 1.0}, ["['a'][1]", "['b']"]),
        "deep_nesting": ({"a": ([x, {"c": x}],)}, {"a": ([x, {"c": -x}],)}, ["['a'][0][1]['c']"]),
        "namedtuple": (Pair(x, 1.0), Pair(x, 1.5), [".b"]),
        "dataclass": (DataLayer(x * 2, 0.5), DataLayer(x, 0.5), [".weight"]),
        "attrs": (AttrsLayer(x, 2.5, "dense"), AttrsLayer(x, 2.0, "dense"), [".scale"]),
        "attrs_static_field": (AttrsLayer(x, 2.0, "dense"), AttrsLayer(x, 2.0, "conv"), [".name"]),
        "equinox_module": (bump(mlp, lambda m: m.layers[1].weight), mlp, [".layers[1].weight"]),
        "torch_named_parameters": (off_params, params, ["['0.weight']"]),
        "jax_arrays": (
            {"w": jnp.ones(3), "v": jnp.zeros(2)},
            {"w": jnp.ones(3).at[1].set(2.0), "v": jnp.zeros(2)},
            ["['w']"],
        ),
        "int_array": ({"i": np.array([1, 2]), "f": x}, {"i": np.array([1, 3]), "f": x}, ["['i']"]),
        "string_leaf": ({"s": "relu", "f": x}, {"s": "tanh", "f": x}, ["['s']"]),
    }


@pytest.mark.parametrize("case", list(mismatching_trees()))
def test_allclose_names_exactly_the_mismatching_paths(case):
    actual, expected, paths = mismatching_trees()[case]
    message = failure(actual, expected)
    assert sorted(failing_paths(message)) == sorted(paths), message


def test_allclose_message_has_errors_and_worst_index():
    expected = np.zeros((3, 4))
    actual = expected.copy()
    actual[1, 2] = 0.5  # the worst entry
    actual[0, 0] = 0.25
    message = failure({"w": actual}, {"w": expected}, rtol=1e-3, atol=1e-8)
    assert "['w']" in message
    assert "2 of 12 entries differ" in message
    assert "max abs error 0.5" in message
    assert "max rel error inf" in message  # against an exact zero
    assert "at index (1, 2)" in message
    assert "rtol=0.001" in message and "atol=1e-08" in message

    message = failure(np.array([1.0, 2.0, 4.0]), np.array([1.0, 2.0, 5.0]))
    assert "max abs error 1," in message and "max rel error 0.2" in message and "at index (2,)" in message


def test_allclose_torch_param_one_percent_off_reports_relative_error():
    params = torch_named_parameters()
    actual = dict(params, **{"2.bias": params["2.bias"] * 1.01})
    message = failure(actual, params, rtol=1e-4, atol=1e-6)
    assert failing_paths(message) == ["['2.bias']"]
    assert "max rel error 0.01" in message


@pytest.mark.parametrize(
    "case",
    [
        "missing_key",
        "extra_key",
        "none_vs_array",
        "array_vs_none",
        "list_vs_tuple",
        "extra_list_leaf",
        "namedtuple_vs_tuple",
        "different_dataclass",
        "eqx_module_vs_dict",
    ],
)
def test_allclose_structure_differences_fail(case):
    x = np.ones(2)
    actual, expected = {
        "missing_key": ({"a": x}, {"a": x, "b": x}),
        "extra_key": ({"a": x, "b": x}, {"a": x}),
        "none_vs_array": ({"a": None}, {"a": x}),
        "array_vs_none": ({"a": x}, {"a": None}),
        "list_vs_tuple": ([x, x], (x, x)),
        "extra_list_leaf": ([x, x, x], [x, x]),
        "namedtuple_vs_tuple": (Pair(x, x), (x, x)),
        "different_dataclass": (DataLayer(x, 1.0), AttrsLayer(x, 1.0, "n")),
        "eqx_module_vs_dict": (eqx.nn.Linear(2, 2, key=jax.random.PRNGKey(0)), {"weight": np.ones((2, 2)), "bias": x}),
    }[case]
    message = failure(actual, expected)
    assert "structure" in message


@pytest.mark.parametrize("framework", ["numpy", "jax", "torch"])
def test_allclose_shape_mismatch_fails(framework):
    make = {"numpy": np.ones, "jax": jnp.ones, "torch": torch.ones}[framework]
    message = failure({"a": make((2, 3))}, {"a": make((3, 2))})
    assert "['a']" in message and "shape (2, 3)" in message and "(3, 2)" in message
    # same size and broadcastable shapes are still a mismatch
    assert "shape" in failure(make((1, 3)), make((3,)))


def test_allclose_nan_in_the_same_place_passes():
    nan = np.array([np.nan, 1.0, np.inf])
    assert compare({"a": nan, "b": 2.0}, {"a": nan.copy(), "b": 2.0}) == 2
    assert compare(jnp.array([jnp.nan, 1.0]), jnp.array([jnp.nan, 1.0])) == 1
    assert compare(torch.tensor([float("nan")]), torch.tensor([float("nan")])) == 1


@pytest.mark.parametrize("direction", ["nan_got", "nan_expected", "inf_vs_number"])
def test_allclose_nan_against_a_number_fails(direction):
    number, bad = np.array([1.0, 2.0]), np.array([1.0, np.inf if direction == "inf_vs_number" else np.nan])
    actual, expected = (bad, number) if direction != "nan_expected" else (number, bad)
    message = failure({"v": actual}, {"v": expected})
    assert failing_paths(message) == ["['v']"]
    assert "at index (1,)" in message


def test_allclose_nan_mismatch_does_not_report_zero_error():
    # A failing leaf whose message says "max abs error 0" sends the reader the wrong way:
    # the NaN entry's error is NaN (or infinite), not zero.
    message = failure({"v": np.array([np.nan, 1.0])}, {"v": np.array([2.0, 1.0])})
    reported = re.search(r"max abs error (\S+?),", message)
    assert reported is not None, message
    assert float(reported.group(1)) != 0.0, message


def test_allclose_complex_leaves_compare_imaginary_parts():
    # Casting complex to float64 would drop the imaginary part and pass two different numbers.
    message = failure({"z": np.array([1.0 + 1.0j])}, {"z": np.array([1.0 + 0.0j])})
    assert "['z']" in message


def test_allclose_ignore_string_list_and_predicate():
    x = np.ones(3)
    actual = {"params": {"w": x + 1, "b": x}, "state": [x + 5, x + 6], "stats": x, "ab": x}
    expected = {"params": {"w": x, "b": x}, "state": [x, x], "stats": x, "ab": x}
    # without ignore, exactly the two mismatching subtrees are named
    assert sorted(failing_paths(failure(actual, expected))) == ["['params']['w']", "['state'][0]", "['state'][1]"]
    # a string path prefix skips the whole subtree; the other mismatch is still reported
    message = failure(actual, expected, ignore="['state']")
    assert failing_paths(message) == ["['params']['w']"]
    # a list of prefixes (an exact leaf path and a subtree)
    assert compare(actual, expected, ignore=["['params']['w']", "['state']"]) == 3
    # a predicate over the path string
    assert compare(actual, expected, ignore=lambda path: path.startswith(("['params']['w']", "['state']"))) == 3
    # a prefix matches whole entries only: "['a']" must not skip "['ab']"
    tree = {"a": x, "ab": x + 1}
    assert failing_paths(failure(tree, {"a": x, "ab": x}, ignore="['a']")) == ["['ab']"]


def test_allclose_ignore_inside_modules():
    mlp = eqx_mlp()
    off = bump(mlp, lambda m: m.layers[1].weight)
    # 8 leaves: weight and bias of 3 layers, and the two activation functions (compared by identity)
    assert compare(off, mlp, ignore=".layers[1]") == 6
    assert compare(off, mlp, ignore=[".layers[1].weight"]) == 7
    params = torch_named_parameters()
    off_params = dict(params, **{"0.weight": params["0.weight"] + 1})
    assert compare(off_params, params, ignore="['0.weight']") == 3
    assert compare(off_params, params, ignore=lambda p: "0." in p and "weight" in p) == 3


@pytest.mark.parametrize(
    "case",
    [
        "empty_dict",
        "empty_list",
        "all_none",
        "nested_none",
        "everything_ignored_by_prefix",
        "everything_ignored_by_predicate",
    ],
)
def test_allclose_refuses_vacuous_pass(case):
    x = np.ones(2)
    actual, expected, kw = {
        "empty_dict": ({}, {}, {}),
        "empty_list": ([], [], {}),
        "all_none": (None, None, {}),
        "nested_none": ({"a": None, "b": [None, (None,)]}, {"a": None, "b": [None, (None,)]}, {}),
        "everything_ignored_by_prefix": ({"a": x, "b": x}, {"a": x, "b": x}, {"ignore": ["['a']", "['b']"]}),
        "everything_ignored_by_predicate": ({"a": x + 1}, {"a": x}, {"ignore": lambda path: True}),
    }[case]
    message = failure(actual, expected, **kw)
    assert "compared no leaf" in message


def test_allclose_returns_the_number_of_compared_leaves():
    x = np.ones(2)
    tree = {"a": x, "b": [x, (x, None)], "n": 3, "s": "name", "none": None}
    assert compare(tree, tree) == 5  # three arrays, an int, a string; None is not a leaf
    assert compare(tree, tree, ignore="['b']") == 3
    assert compare(eqx_mlp(), eqx_mlp()) == 8
    assert compare(torch_named_parameters(), torch_named_parameters()) == 4


def test_allclose_tolerance_boundary():
    # |a - e| <= atol + rtol * |e|, evaluated exactly: 0.25 + 0.5 * 4 == 2.25 == 6.25 - 4 == 4 - 1.75
    e = np.array([4.0])
    for inside in (6.25, 1.75):
        assert compare(np.array([inside]), e, rtol=0.5, atol=0.25) == 1
    # one ulp above the upper bound; below, 2**-40 (4 - a must stay exact: 1 ulp of 1.75 would round away)
    for outside in (np.nextafter(6.25, np.inf), 1.75 - 2.0**-40):
        failure(np.array([outside]), e, rtol=0.5, atol=0.25)
    # the tolerance is relative to the expected value, not the actual one
    compare(np.array([100.0]), np.array([150.0]), rtol=0.4, atol=0.0)  # |50| <= 0.4 * 150 = 60
    failure(np.array([150.0]), np.array([100.0]), rtol=0.4, atol=0.0)  # |50| > 0.4 * 100 = 40
    # atol alone near zero
    compare(np.array([1e-9]), np.array([0.0]), rtol=0.0, atol=1e-9)
    failure(np.array([np.nextafter(1e-9, 1)]), np.array([0.0]), rtol=0.0, atol=1e-9)
    # float32 leaves are compared in float64: a float32 rounding error is visible at tight tolerance
    failure(np.float32(0.1), 0.1, rtol=1e-12, atol=0.0)
    compare(np.float32(0.1), 0.1, rtol=1e-7, atol=0.0)


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    rtol=st.sampled_from([0.0, 1e-6, 1e-3, 0.1]),
    atol=st.sampled_from([0.0, 1e-8, 1e-3]),
)
def test_allclose_agrees_with_the_formula(data, rtol, atol):
    shape = data.draw(hnp.array_shapes(min_dims=0, max_dims=2, max_side=4))
    floats = st.floats(-1e3, 1e3, allow_nan=False)
    expected = data.draw(hnp.arrays(np.float64, shape, elements=floats))
    noise = data.draw(hnp.arrays(np.float64, shape, elements=st.sampled_from([0.0, 1e-9, -1e-7, 1e-4, 0.05])))
    actual = expected * (1 + noise) + noise * 1e-3
    should_pass = bool(np.all(np.abs(actual - expected) <= atol + rtol * np.abs(expected)))
    if should_pass:
        assert assert_tree_allclose({"x": actual}, {"x": expected}, rtol=rtol, atol=atol) == 1
    else:
        with pytest.raises(AssertionError, match=re.escape("['x']")):
            assert_tree_allclose({"x": actual}, {"x": expected}, rtol=rtol, atol=atol)


# ============================================================================ 2. broken backends are caught


def one_leaf_off(leaves: tuple) -> tuple:
    """One derivative leaf 1% off: the smallest realistic bug a backend can have.

    The leaf is chosen from shapes alone (it must be, under jit and vmap): the
    largest, the last of equally large ones. Neither the first nor the last leaf
    will do: Maxout's first branch never wins, so its gradient is exactly zero,
    and the last leaf of an Equinox attention layer is its dropout rate, a float
    with zero gradient; 1% of zero is no error at all.
    """
    sizes = [int(np.prod(np.shape(leaf))) for leaf in leaves]
    k = max(range(len(leaves)), key=lambda i: (sizes[i], i))
    return tuple(leaf * 1.01 if i == k else leaf for i, leaf in enumerate(leaves))


@attrs.frozen
class WrongTorch(ad.AutoTorch):
    """AutoTorch with the first derivative leaf of every primitive 1% off (values untouched)."""

    def jvp(self, F, xs, ts, batched):
        ys, aux, dys = super().jvp(F, xs, ts, batched)
        return ys, aux, one_leaf_off(dys)

    def vjp(self, F, xs):
        ys, aux, pull = super().vjp(F, xs)
        return ys, aux, lambda cts, batched: one_leaf_off(pull(cts, batched))

    def value_and_grad(self, F, xs):
        ys, aux, grads = super().value_and_grad(F, xs)
        return ys, aux, one_leaf_off(grads)


@attrs.frozen
class WrongJAX(ad.AutoJAX):
    """AutoJAX with the first derivative leaf of every primitive 1% off (values untouched)."""

    def jvp(self, F, xs, ts, batched):
        ys, aux, dys = super().jvp(F, xs, ts, batched)
        return ys, aux, one_leaf_off(dys)

    def vjp(self, F, xs):
        ys, aux, pull = super().vjp(F, xs)
        return ys, aux, lambda cts, batched: one_leaf_off(pull(cts, batched))

    def value_and_grad(self, F, xs):
        ys, aux, grads = super().value_and_grad(F, xs)
        return ys, aux, one_leaf_off(grads)


WRONG = {"torch": WrongTorch, "jax": WrongJAX}


def run_expecting_failure(backend: Any, scenarios: list[Scenario]) -> tuple[dict[str, Any], str | None]:
    """Outcomes by scenario name, and the AssertionError's message (None if nothing was raised)."""
    outcomes: list = []
    try:
        test_differentiation([backend], scenarios, progress=outcomes.append)
    except AssertionError as error:
        return {o.scenario: o for o in outcomes}, str(error)
    return {o.scenario: o for o in outcomes}, None


@pytest.fixture(scope="module")
def wrong_runs(request):
    """Each wrong backend run once on its whole scenario list; the tests look up their scenario."""
    cache: dict[tuple[str, str], tuple] = {}

    def get(framework: str, catalogue: str) -> tuple[dict[str, Any], str | None]:
        if (framework, catalogue) not in cache:
            scenarios = request.getfixturevalue(f"{catalogue}_{framework}")
            if catalogue == "nn":
                named = by_name(scenarios)
                scenarios = [named[name] for name in NN_SAMPLE[framework]]
            cache[framework, catalogue] = run_expecting_failure(WRONG[framework](), scenarios)
        return cache[framework, catalogue]

    return get


def assert_caught(outcomes: dict, message: str | None, backend: str, name: str) -> None:
    assert message is not None, f"test_differentiation raised nothing: {backend} passed everything"
    outcome = outcomes[name]
    assert outcome.status == "FAIL", f"{backend} was not caught on {name}: {outcome}"
    assert f"{backend} on {name}:" in message
    # both modes run the broken primitives, and both are reported
    assert "unprepared: wrong result" in outcome.message and "prepared: wrong result" in outcome.message


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("name", DEFAULT_NAMES)
def test_wrong_gradient_caught_on_every_default_scenario(wrong_runs, framework, name):
    outcomes, message = wrong_runs(framework, "default")
    assert_caught(outcomes, message, WRONG[framework].__name__, name)


@pytest.mark.parametrize(
    "framework, name", [(fw, name) for fw, names in NN_SAMPLE.items() for name in names], ids=lambda v: v
)
def test_wrong_gradient_caught_on_nn_scenarios(wrong_runs, framework, name):
    outcomes, message = wrong_runs(framework, "nn")
    assert_caught(outcomes, message, WRONG[framework].__name__, name)


def test_wrong_backend_failure_names_path_and_shows_table(wrong_runs):
    outcomes, message = wrong_runs("torch", "default")
    assert message is not None
    # the message of one scenario names the leaf that is off: the gradient of several_to_scalar is (w, b)
    several = outcomes["gradient-several_to_scalar"].message
    assert failing_paths(several.split("unprepared: wrong result: ")[1].split("\n  prepared")[0]) == ["[0]"], several
    assert "max rel error 0.01" in several
    # and the whole message ends with the table of every scenario
    assert f"{len(DEFAULT_NAMES)} failure(s)" in message
    assert "| scenario" in message and "WrongTorch" in message
    assert f"0 passed, {len(DEFAULT_NAMES)} failed, 0 unsupported" in message


@attrs.frozen
class MutatingFiniteDifferences(ad.AutoFiniteDifferences):
    """Adds 1 in place to the first float numpy Constant on every call."""

    def convert_inputs(self, xs, ctx):
        for leaf in ctx:
            if isinstance(leaf, np.ndarray) and leaf.dtype.kind == "f":
                leaf += 1.0
                break
        return super().convert_inputs(xs, ctx)


@attrs.frozen
class MutatingTorch(ad.AutoTorch):
    """Adds 1 in place to the first float tensor Constant on every call."""

    def convert_inputs(self, xs, ctx):
        for leaf in ctx:
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                with torch.no_grad():
                    leaf.add_(1.0)
                break
        return super().convert_inputs(xs, ctx)


def square_loss(w, x):
    return ((w * x) ** 2).sum()


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_backend_mutating_a_constant_is_caught(framework):
    if framework == "numpy":
        backend, w, x, prep_x = MutatingFiniteDifferences(), np.ones(3), np.arange(3.0), np.arange(3.0) + 1
    else:
        backend, w, x, prep_x = MutatingTorch(), torch.ones(3), torch.arange(3.0), torch.arange(3.0) + 1
    expected = 2 * np.arange(3.0) ** 2
    scenario = Scenario(
        "gradient",
        square_loss,
        (Active(w), Constant(x)),
        prep_args=(Active(w + 1), Constant(prep_x)),
        result=expected,
        name="mutated",
    )
    with pytest.raises(AssertionError) as info:
        test_differentiation([backend], [scenario])
    message = str(info.value)
    assert f"{type(backend).__name__} on mutated:" in message
    assert "unprepared: argument 1 (constant) was modified" in message
    assert "prepared: argument 1 (constant) was modified" in message


@attrs.frozen
class ModuleRunningTorch(ad.AutoTorch):
    """Binds the user's own buffers in the view instead of copies: BatchNorm statistics change."""

    def bind_module(self, module, params):
        from activity.backends._torch_modules import bound_view

        return bound_view(module, params, lambda tensor: tensor)


def test_backend_updating_batchnorm_statistics_is_caught():
    scenario = by_name(nn_scenarios("torch"))["batchnorm1d_train"]  # a fresh copy: this test changes it
    with pytest.raises(AssertionError) as info:
        test_differentiation([ModuleRunningTorch()], [scenario])
    message = str(info.value)
    assert "ModuleRunningTorch on batchnorm1d_train:" in message
    assert "argument 0 (active) was modified" in message


@attrs.frozen
class RNGConsuming(ad.AutoTorch):
    """Draws one number from a global RNG on every gradient."""

    rng: str = "numpy"

    def value_and_grad(self, F, xs):
        {"numpy": np.random.random, "python": random.random, "torch": lambda: torch.rand(1)}[self.rng]()
        return super().value_and_grad(F, xs)


@pytest.mark.parametrize("rng", ["numpy", "python", "torch"])
def test_backend_consuming_a_global_rng_is_caught(default_torch, rng):
    gradients = [s for s in default_torch if s.op == "gradient"]
    assert len(gradients) >= 4
    outcomes, message = run_expecting_failure(RNGConsuming(rng=rng), gradients)
    assert message is not None, f"a backend drawing from the global {rng} RNG passed"
    for s in gradients:
        assert outcomes[s.name].status == "FAIL", f"the draw from the global {rng} RNG was missed on {s.name}"
        module = {"numpy": "numpy", "python": "random", "torch": "torch"}[rng]
        assert f"the global {module} RNG state changed" in outcomes[s.name].message


@attrs.frozen
class StaleTorch(ad.AutoTorch):
    """A prepared operator that computes its first result and returns it forever."""

    def compile(self, pipeline):
        compiled = super().compile(pipeline)
        first: list = []

        def run(*args):
            if not first:
                first.append(compiled(*args))
            return first[0]

        return run


def test_stale_prepared_results_are_caught(default_torch):
    scenarios = first_per_operator(default_torch)
    assert all(s.prep_args is not None for s in scenarios)
    outcomes, message = run_expecting_failure(StaleTorch(), scenarios)
    stale = [name for name, o in outcomes.items() if o.status != "FAIL"]
    assert message is not None and not stale, f"a backend returning its first prepared result forever passed on {stale}"
    for s in scenarios:
        assert "prepared: wrong result" in outcomes[s.name].message


@attrs.frozen
class PreparationValuesTorch(ad.AutoTorch):
    """A prepared operator that differentiates at the values it was prepared with.

    `as_array` sees every Active leaf when the problem is built; `compile` keeps
    the preparation's leaves and runs the pipeline on them on every call.
    """

    seen: list = attrs.field(factory=list, eq=False, repr=False)

    def as_array(self, leaf):
        self.seen.append(leaf)
        return super().as_array(leaf)

    def compile(self, pipeline):
        at_preparation = list(self.seen)

        def run(xs, ctx, extra):
            return pipeline(tuple(at_preparation[len(at_preparation) - len(xs) :]), ctx, extra)

        return run


def test_prep_args_catch_a_backend_that_uses_preparation_values(default_torch):
    scenarios = [s for s in first_per_operator(default_torch) if s.prep_args is not None]
    outcomes, message = run_expecting_failure(PreparationValuesTorch(), scenarios)
    assert message is not None
    for s in scenarios:
        assert outcomes[s.name].status == "FAIL"
        assert "prepared: wrong result" in outcomes[s.name].message
        assert "unprepared: wrong result" not in outcomes[s.name].message
    # the control: without prep_args the same backend is indistinguishable from a correct one
    report = test_differentiation([PreparationValuesTorch()], [s.derive(prep_args=None) for s in scenarios])
    assert report.counts()["pass"] == len(scenarios)


@attrs.frozen
class GradPollutingTorch(ad.AutoTorch):
    """Leaves ``.grad`` set on the user's parameters, like a stray ``loss.backward()``."""

    def bind_module(self, module, params):
        for p in module.params:  # the user's own parameters
            p.grad = torch.zeros_like(p)
        return super().bind_module(module, params)


def test_backend_setting_grad_on_parameters_is_caught():
    scenario = by_name(nn_scenarios("torch"))["linear"]  # a fresh copy: this test changes it
    with pytest.raises(AssertionError, match="argument 0 \\(active\\) was modified"):
        test_differentiation([GradPollutingTorch()], [scenario])


@attrs.frozen
class RaisingTorch(ad.AutoTorch):
    def jvp(self, F, xs, ts, batched):
        raise RuntimeError("no forward mode today")


@attrs.frozen
class NoSecondOrderTorch(ad.AutoTorch):
    def supports(self, operator, kind, mode="unprepared"):
        return "hess" not in operator and "second" not in operator and super().supports(operator, kind, mode)


def test_exceptions_are_failures_and_unsupported_is_not(default_torch):
    pushforwards = [s for s in default_torch if s.op == "pushforward"]
    outcomes, message = run_expecting_failure(RaisingTorch(), pushforwards)
    assert message is not None and {o.status for o in outcomes.values()} == {"FAIL"}
    assert "unprepared: raised RuntimeError: no forward mode today" in message
    assert "prepared: raised RuntimeError: no forward mode today" in message

    report = test_differentiation([NoSecondOrderTorch()], default_torch)
    unsupported = {o.scenario for o in report.outcomes if o.status == "unsupported"}
    assert unsupported == {s.name for s in default_torch if "hess" in s.op or "second" in s.op}
    assert report.counts()["FAIL"] == 0 and report.counts()["pass"] == len(default_torch) - len(unsupported)


def test_a_failing_reference_is_reported_with_the_scenario():
    def f(x):
        raise ValueError("f cannot run")

    s = Scenario("gradient", f, [Active(np.ones(2))], name="broken_f")
    with pytest.raises(AssertionError, match="the reference failed on broken_f: ValueError: f cannot run"):
        test_differentiation([ad.AutoFiniteDifferences()], [s])


def test_the_reference_backend_is_the_one_given(default_torch):
    # references are cached per reference backend; the default scenarios carry analytic results, dropped here
    scenarios = [attrs.evolve(s, result=None) for s in first_per_operator(default_torch)]
    # a correct backend checked against a wrong reference fails: the reference is really used
    outcomes: list = []
    with pytest.raises(AssertionError):
        test_differentiation([ad.AutoTorch()], scenarios, reference=WrongTorch(), progress=outcomes.append)
    assert [o.status for o in outcomes] == ["FAIL"] * len(scenarios)
    # and an AD reference agrees with finite differences on the same scenarios
    report = test_differentiation([ad.AutoTorch()], scenarios, reference=ad.AutoTorch())
    assert report.counts()["pass"] == len(scenarios)


# ============================================================================ 3. the full catalogues pass


@pytest.fixture(scope="module")
def torch_report(default_torch, nn_torch):
    return test_differentiation([ad.AutoTorch(), ad.AutoJAX()], default_torch + nn_torch)


@pytest.fixture(scope="module")
def jax_report(default_jax, nn_jax):
    return test_differentiation([ad.AutoJAX(), ad.AutoTorch()], default_jax + nn_jax)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_full_catalogue_passes(request, framework):
    report = request.getfixturevalue(f"{framework}_report")
    scenarios = request.getfixturevalue(f"default_{framework}") + request.getfixturevalue(f"nn_{framework}")
    native = {"torch": "AutoTorch", "jax": "AutoJAX"}[framework]
    other = {"torch": "AutoJAX", "jax": "AutoTorch"}[framework]
    assert report.failures == []
    assert report.counts() == {"pass": len(scenarios), "FAIL": 0, "unsupported": 0}  # n/a is not counted
    assert {o.scenario for o in report.outcomes if o.backend == native and o.status == "pass"} == {
        s.name for s in scenarios
    }
    # the other framework's backend is listed as not applicable, never run, never a failure
    assert {o.status for o in report.outcomes if o.backend == other} == {"n/a"}


def test_finite_differences_pass_the_numpy_catalogue(default_numpy):
    report = test_differentiation([ad.AutoFiniteDifferences()], default_numpy)
    assert report.counts() == {"pass": len(default_numpy), "FAIL": 0, "unsupported": 0}
    assert report.backends == ["AutoFiniteDifferences"]


def test_report_prints_a_backend_by_scenario_table(torch_report, default_torch, nn_torch):
    text = str(torch_report)
    assert text == torch_report.table()
    lines = text.splitlines()
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert header == ["scenario", "AutoTorch", "AutoJAX"]
    assert set(lines[1].replace("|", "").replace(" ", "")) == {"-"}
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:] if line.startswith("|")]
    scenarios = default_torch + nn_torch
    assert [row[0] for row in rows] == [s.name for s in scenarios]
    assert all(row[1:] == ["pass", "n/a"] for row in rows)
    assert lines[-1] == f"{len(scenarios)} passed, 0 failed, 0 unsupported"


def test_catalogue_contents(default_numpy, default_torch, default_jax, nn_torch, nn_jax):
    for scenarios in (default_numpy, default_torch, default_jax):
        assert {s.op for s in scenarios} == OPERATORS
        assert [s.name for s in scenarios] == DEFAULT_NAMES
        assert all(s.prep_args is not None for s in scenarios)
        kinds = {k for s in scenarios for k in s.kinds}
        assert {"active", "constant"} <= kinds
        assert any(s.kinds.count("active") >= 2 for s in scenarios)
    assert {s.framework for s in default_torch} == {"torch"}
    assert {s.framework for s in default_jax} == {"jax"}
    assert {s.framework for s in default_numpy} == {"numpy"}

    assert len(nn_torch) >= 25 and len(nn_jax) >= 15
    for scenarios, framework in ((nn_torch, "torch"), (nn_jax, "jax")):
        names = list(by_name(scenarios))
        assert all(
            s.op == "gradient" and s.kinds == ("active", "constant") and s.prep_args is not None for s in scenarios
        )
        assert {s.framework for s in scenarios} == {framework}
        joined = " ".join(names)
        for layer in (
            "linear",
            "conv",
            "lstm",
            "gru",
            "batchnorm",
            "layernorm",
            "groupnorm",
            "multihead_attention",
            "embedding",
            "maxout",
            "bilinear",
            "skipconnection",
            "convtranspose",
            "pool",
        ):
            assert layer in joined, f"nn_scenarios({framework!r}) has no {layer} scenario: {names}"
    torch_names = " ".join(s.name for s in nn_torch)
    for layer in ("rnn", "instancenorm", "scale"):
        assert layer in torch_names
    assert all(isinstance(s.args[0].value, torch.nn.Module) for s in nn_torch)


def test_nn_scenarios_rejects_unknown_framework():
    with pytest.raises(ValueError, match="numpy"):
        nn_scenarios("numpy")
    with pytest.raises(ValueError):
        default_scenarios("tensorflow")


# ============================================================================ 4. transforms keep the expected result

TRANSFORMS = {"constantify": constantify, "cachify": cachify, "closurify": closurify, "batchify": batchify}
FRAMEWORKS = ["numpy", "torch", "jax"]


def transformed_pairs(scenarios: list[Scenario], transform: str) -> list[tuple[Scenario, Scenario]]:
    """(original, transformed) for every scenario the transform changes."""
    pairs = list(zip(scenarios, TRANSFORMS[transform](scenarios)))
    return [(s, t) for s, t in pairs if t is not s]


def batched_expected(s: Scenario, result: Any) -> Any:
    """``[r, 2 r]`` (after the value for value-first operators): what a batch ``[t, 2 t]`` must give."""
    if s.op in VALUE_FIRST:
        head, single = result
        return head, [single, _scale_tree(single, 2.0)]
    return [result, _scale_tree(result, 2.0)]


def _scale_tree(tree: Any, factor: float) -> Any:
    if isinstance(tree, dict):
        return {k: _scale_tree(v, factor) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_scale_tree(v, factor) for v in tree)
    if isinstance(tree, (np.ndarray, np.generic, float, torch.Tensor, jax.Array)):
        return tree * factor
    return tree


def same_objects(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_transform_structure(request, transform, framework):
    scenarios = request.getfixturevalue(f"default_{framework}")
    transformed = TRANSFORMS[transform](scenarios)
    assert isinstance(transformed, list) and len(transformed) == len(scenarios)
    assert TRANSFORMS[transform](scenarios[0]).name == transformed[0].name  # a single scenario works too
    for s, t in zip(scenarios, transformed):
        assert t.op == s.op and t.framework == s.framework and t.options == s.options
        if transform == "constantify":
            assert t.kinds == (*s.kinds, "constant") and same_objects(t.args[:-1], s.args)
            assert same_objects(t.prep_args[:-1], s.prep_args) and t.prep_args[-1].kind == "constant"
            assert t.name == s.name + "+constant"
        elif transform == "cachify":
            assert t.kinds == (*s.kinds, "cache") and same_objects(t.args[:-1], s.args)
            assert same_objects(t.prep_args[:-1], s.prep_args) and t.prep_args[-1].kind == "cache"
            assert t.prep_args[-1].value is not t.args[-1].value  # preparation and call do not share a buffer
            assert t.name == s.name + "+cache"
        elif transform == "closurify":
            assert "constant" not in t.kinds
            assert same_objects(t.args, tuple(a for a in s.args if a.kind != "constant"))
            assert same_objects(t.prep_args, tuple(a for a in s.prep_args if a.kind != "constant"))
            assert t.name == s.name + "+closure"
        else:
            if s.op in SEEDED:
                assert s.tangent is not None and t.tangent is None
                assert len(t.tangents) == 2 and same_objects(t.args, s.args) and t.name == s.name + "+batch"
                compare(t.tangents[0], s.tangent, rtol=0.0)
                compare(t.tangents[1], _scale_tree(s.tangent, 2.0), rtol=0.0)
            else:
                assert t is s
    assert len({t.name for t in transformed}) == len(transformed)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_transform_expected_result_is_the_originals(request, transform, framework):
    scenarios = request.getfixturevalue(f"default_{framework}")
    pairs = transformed_pairs(scenarios, transform)
    assert pairs
    for s, t in pairs:
        want = batched_expected(s, s.expected()) if transform == "batchify" else s.expected()
        compare(t.expected(), want, rtol=1e-12, atol=0.0)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_reference_reaches_the_expected_result_on_transformed_scenarios(request, transform, framework):
    """The reference backend, run on the transformed scenario itself, gives the original's result."""
    scenarios = request.getfixturevalue(f"default_{framework}")
    if framework != "numpy":  # every operator still covered; the numpy catalogue is run in full
        scenarios = (
            first_per_operator(scenarios) if transform != "batchify" else [s for s in scenarios if s.op in SEEDED]
        )
    pairs = transformed_pairs(scenarios, transform)
    assert pairs
    for s, t in pairs:
        got = t.run(ad.AutoFiniteDifferences())
        want = batched_expected(s, s.expected()) if transform == "batchify" else s.expected()
        try:
            compare(got, want, rtol=1e-4, atol=1e-5)
        except AssertionError as error:
            raise AssertionError(f"{t.name}: {error}") from None


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_ad_backends_pass_transformed_scenarios(request, transform, framework):
    scenarios = request.getfixturevalue(f"default_{framework}")
    if framework == "jax":  # compiling every scenario is the cost: one per operator (all seeded ones for batchify)
        scenarios = (
            first_per_operator(scenarios) if transform != "batchify" else [s for s in scenarios if s.op in SEEDED]
        )
    transformed = [t for _, t in transformed_pairs(scenarios, transform)]
    backend = {"torch": ad.AutoTorch(), "jax": ad.AutoJAX()}[framework]
    report = test_differentiation([backend], transformed)
    assert report.counts() == {"pass": len(transformed), "FAIL": 0, "unsupported": 0}


def test_transforms_compose(default_numpy):
    s = by_name(default_numpy)["pullback-several_to_vector"]
    t = batchify(cachify(constantify(s)))
    assert t.kinds == (*s.kinds, "constant", "cache") and len(t.tangents) == 2
    compare(t.run(ad.AutoFiniteDifferences()), batched_expected(s, s.expected()), rtol=1e-4, atol=1e-5)
    closed = closurify(constantify(s))
    assert "constant" not in closed.kinds
    compare(closed.run(ad.AutoFiniteDifferences()), s.expected(), rtol=1e-4, atol=1e-5)


def test_wrong_backend_caught_on_transformed_scenarios(default_torch):
    scenarios = first_per_operator(default_torch)
    for transform in TRANSFORMS.values():
        transformed = [t for t in transform(scenarios) if t not in scenarios]
        outcomes, message = run_expecting_failure(WrongTorch(), transformed)
        assert message is not None
        assert {o.status for o in outcomes.values()} == {"FAIL"}, transform.__name__


# ============================================================================ 5. Scenario


def cube_sum(x):
    return (x**3).sum()


def test_scenario_op_as_function_or_name():
    args = (Active(np.array([1.0, 2.0])),)
    by_function, by_name_ = Scenario(ad.gradient, cube_sum, args), Scenario("gradient", cube_sum, args)
    assert by_function.op == by_name_.op == "gradient"
    assert by_function.name == by_name_.name == "gradient-cube_sum"
    assert by_function.args == by_name_.args == args
    fd = ad.AutoFiniteDifferences()
    compare(by_function.run(fd), by_name_.run(fd), rtol=0.0)
    compare(by_function.expected(), np.array([3.0, 12.0]), rtol=1e-6)
    compare(by_function.run(fd, prepared=True), np.array([3.0, 12.0]), rtol=1e-6)
    for op in OPERATORS:
        seed = {"tangent": np.ones(2)} if op in SEEDED else {}
        assert Scenario(getattr(ad, op), cube_sum, args, **seed).op == op


def test_scenario_public_fields_and_errors():
    args = [Active(np.ones(2)), Constant(np.zeros(2))]
    s = Scenario("gradient", lambda w, x: (w * x).sum(), args, name="dot", rtol=1e-3, atol=1e-4)
    assert s.name == "dot" and s.args == tuple(args) and isinstance(s.args, tuple)
    assert s.kinds == ("active", "constant") and s.framework == "numpy"
    assert "dot" in repr(s) and "gradient" in repr(s)
    with pytest.raises(TypeError, match="unannotated"):
        Scenario("gradient", cube_sum, [np.ones(2)])
    with pytest.raises(TypeError, match="not an activity operator"):
        Scenario("gradiant", cube_sum, [Active(np.ones(2))])
    with pytest.raises(TypeError, match="tangent"):
        Scenario("pushforward", cube_sum, [Active(np.ones(2))])
    with pytest.raises(TypeError, match="tangent"):
        Scenario("pushforward", cube_sum, [Active(np.ones(2))], tangent=np.ones(2), tangents=[np.ones(2)])


def test_scenario_given_result_is_used_and_checked():
    s = Scenario("gradient", cube_sum, [Active(np.array([1.0, 2.0]))], result=np.array([3.0, 12.0]))
    assert s.expected() is s.result
    test_differentiation([ad.AutoFiniteDifferences()], [s])
    wrong = Scenario(
        "gradient", cube_sum, [Active(np.array([1.0, 2.0]))], result=np.array([3.0, 12.5]), name="wrong_result"
    )
    with pytest.raises(AssertionError, match="AutoFiniteDifferences on wrong_result"):
        test_differentiation([ad.AutoFiniteDifferences()], [wrong])


def test_scenario_prep_args_may_be_a_list_like_args():
    # args are accepted as a list; prep_args must be too (and both are stored as tuples)
    s = Scenario(
        "gradient", cube_sum, [Active(np.array([1.0, 2.0]))], prep_args=[Active(np.array([3.0, 4.0]))], name="listed"
    )
    report = test_differentiation([ad.AutoFiniteDifferences()], [s])
    assert report.counts()["pass"] == 1
    assert isinstance(s.args, tuple) and isinstance(s.prep_args, tuple)


def test_scenario_reference_is_computed_once():
    calls = []

    def f(x):
        calls.append(1)
        return (x**2).sum()

    s = Scenario("gradient", f, [Active(np.ones(2))])
    first = s.expected()
    n = len(calls)
    assert n > 0
    assert s.expected() is first and len(calls) == n
    assert s.derive(name="again").expected() is first and len(calls) == n


def test_scenario_tolerances_override_the_defaults():
    loose = Scenario("gradient", cube_sum, [Active(np.ones(2))], result=np.array([3.03, 3.0]), rtol=0.02, name="loose")
    test_differentiation([ad.AutoFiniteDifferences()], [loose])
    with pytest.raises(AssertionError, match="loose"):
        test_differentiation([ad.AutoFiniteDifferences()], [attrs.evolve(loose, rtol=None)])


# ============================================================================ 6. not collected by pytest


def test_test_differentiation_is_not_a_test():
    assert test_differentiation.__test__ is False


def test_importing_test_differentiation_does_not_make_pytest_collect_it(tmp_path):
    (tmp_path / "test_user_suite.py").write_text(
        textwrap.dedent(
            """
            from activity.testing import test_differentiation, check_scenario

            def test_mine():
                pass
            """
        )
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "test_user_suite.py"],
        check=False,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "test_user_suite.py::test_mine" in output
    assert "test_differentiation" not in output
    assert "1 test collected" in output, output


# ============================================================================ 7. explicit seeds


def global_rng_states() -> tuple:
    return random.getstate(), np.random.get_state(), torch.random.get_rng_state().clone()


def assert_same_rng_states(before: tuple, after: tuple) -> None:
    assert before[0] == after[0], "the Python random state changed"
    assert before[1][0] == after[1][0] and all(np.array_equal(b, a) for b, a in zip(before[1][1:], after[1][1:])), (
        "the numpy global RNG state changed"
    )
    assert torch.equal(before[2], after[2]), "the torch global RNG state changed"


def arrays_of(args: tuple) -> list[np.ndarray]:
    """Every array of some annotated arguments (module states included) as numpy."""
    out = []
    for arg in args:
        value = arg.value
        if isinstance(value, torch.nn.Module):
            out += [t.detach().numpy() for t in value.state_dict().values()]
        else:
            out += [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(eqx.filter(value, eqx.is_array))]
    return out


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_nn_scenarios_leave_global_rngs_alone(framework):
    before = global_rng_states()
    nn_scenarios(framework, seed=7)
    assert_same_rng_states(before, global_rng_states())
    default_scenarios(framework)
    assert_same_rng_states(before, global_rng_states())


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_nn_scenarios_are_a_function_of_the_seed(request, framework):
    seed0 = request.getfixturevalue(f"nn_{framework}")  # seed=0, the default
    again, other = nn_scenarios(framework, seed=0), nn_scenarios(framework, seed=1)
    assert [s.name for s in again] == [s.name for s in seed0] == [s.name for s in other]
    for a, b, c in zip(seed0, again, other):
        arrays_a, arrays_b, arrays_c = (arrays_of(s.args + s.prep_args) for s in (a, b, c))
        assert len(arrays_a) == len(arrays_b) == len(arrays_c) > 0
        for x, y in zip(arrays_a, arrays_b):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), f"{a.name}: seed 0 twice differs"
        assert any(x.shape != y.shape or not np.array_equal(x, y) for x, y in zip(arrays_a, arrays_c)), (
            f"{a.name}: seeds 0 and 1 give the same values"
        )
        # the args and the preparation args differ, so a stale prepared result is visible
        assert any(
            x.shape != y.shape or not np.array_equal(x, y) for x, y in zip(arrays_of(a.args), arrays_of(a.prep_args))
        ), f"{a.name}: prep_args equal args"


def test_default_scenarios_are_deterministic():
    for framework in FRAMEWORKS:
        first, second = default_scenarios(framework), default_scenarios(framework)
        for a, b in zip(first, second):
            compare([x.value for x in a.args + a.prep_args], [y.value for y in b.args + b.prep_args], rtol=0.0)
            if a.tangent is not None:
                compare(a.tangent, b.tangent, rtol=0.0)

"""`activity.prepare` on JAX in the wild: dict key order, models with non-array leaves,
bounded lenient preparation, static constants, and placeholders instead of data.

Expected values come from hand-written ``jax.jit(jax.grad(...))`` / ``jax.jacrev`` /
``jax.hessian`` / ``jax.jvp`` calls, ``eqx.filter_grad``, ``torch.autograd.grad`` or
analytic formulas, never from ``activity``. Traces are counted with a side effect in f
(it runs only when JAX traces it); compilations with ``jax.log_compiles``.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import types
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import activity as ad
from activity import Active, Cache, Constant

TOL = dict(rtol=1e-5, atol=1e-5)
S = jax.ShapeDtypeStruct


def counted(f):
    """``f`` and the list it appends to on each run: under JAX, one entry per trace."""
    traces = []

    def counted_f(*args, **kwargs):
        traces.append(1)
        return f(*args, **kwargs)

    return counted_f, traces


@contextlib.contextmanager
def compilations():
    """The names of the functions XLA compiles inside the block."""
    names: list[str] = []

    class Record(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if message.startswith("Finished XLA compilation of "):
                names.append(message.split(" of ", 1)[1].split(" in ")[0])

    handler = Record()
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles():
            yield names
    finally:
        logger.removeHandler(handler)


def key_order(tree):
    """Every dict's keys in order, nested: the part of a result JAX's pytrees would sort."""
    if isinstance(tree, dict):
        return [(key, key_order(value)) for key, value in tree.items()]
    if isinstance(tree, (list, tuple)):
        return [key_order(value) for value in tree]
    return "."


def assert_close_by_key(actual, expected, path=""):
    """Values compared leaf by leaf, dicts by key (JAX's own results have sorted keys)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), f"{path}: keys {list(actual)}"
        for key in expected:
            assert_close_by_key(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), path
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_close_by_key(a, e, f"{path}[{index}]")
    else:
        assert isinstance(actual, jax.Array), f"{path}: {type(actual).__name__}"
        np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), **TOL, err_msg=path)


def assert_same_arrays(actual, expected):
    """The array leaves of two Equinox modules, in order, close."""
    got, want = (jax.tree.leaves(eqx.filter(tree, eqx.is_array)) for tree in (actual, expected))
    assert len(got) == len(want) > 0
    for a, e in zip(got, want):
        np.testing.assert_allclose(a, e, **TOL)


def activity_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "activity" in str(w.message)]


# ---------------------------------------------------------------- (7) dict key order


def params(n: int = 2) -> dict:
    """Keys inserted out of sorted order at both levels: JAX's pytrees would sort them."""
    return {
        "w": {"z": jnp.linspace(0.1, 0.9, n), "b": jnp.array([0.3, -0.2, 0.5])},
        "a": jnp.asarray(0.7),
    }


def scalar_f(p):
    return jnp.sum(jnp.sin(p["w"]["z"]) ** 2) * p["a"] + jnp.sum(p["w"]["b"] ** 3) * p["a"] ** 2


def vector_f(p):  # an output dict, also out of sorted order
    return {"y": jnp.tanh(p["w"]["z"]) * p["a"], "c": p["w"]["b"] ** 2 * p["a"]}


def aux_f(p):
    return scalar_f(p), {"s": "text", "n": p["a"] * 2, "b": jnp.sum(p["w"]["z"])}


def flat_params() -> dict:
    """One level, keys out of sorted order, a different shape each: a value under the wrong key shows."""
    return {"w1": jnp.linspace(0.1, 0.9, 4).reshape(2, 2), "b1": jnp.array([0.3, -0.2]), "a": jnp.array([0.5, 0.1, -0.4])}


def flat_f(p):
    return jnp.sum(jnp.sin(p["w1"]) ** 2) + jnp.sum(p["b1"] ** 3) + jnp.sum(jnp.tanh(p["a"]))


def nested_f(p):
    return flat_f(p["outer"]) + jnp.sum(p["scale"] * p["outer"]["a"])


def test_a_nested_result_keeps_its_layout_when_jax_traces_the_prepared_call_again():
    """The prepared call is traced once more for weakly typed arrays (the same signature as
    activity sees it, another one for JAX): the result, whose arrays leave the compiled call
    as a tuple, is still rebuilt with its keys in the argument's order, None where masked."""
    p = {"scale": jnp.asarray(1.5, dtype=jnp.float32), "outer": flat_params()}
    where = {"scale": False, "outer": {"w1": True, "b1": False, "a": True}}
    prepared = ad.prepare(ad.gradient, nested_f, Active(p, where=where))
    weak = {"scale": jnp.asarray(0.5), "outer": flat_params()}  # a weakly typed float32 scalar
    assert weak["scale"].weak_type and not p["scale"].weak_type
    for q in (p, weak, p):
        got = prepared(q)
        want = jax.grad(nested_f)(q)
        assert list(got) == ["scale", "outer"] and got["scale"] is None
        assert list(got["outer"]) == ["w1", "b1", "a"] and got["outer"]["b1"] is None
        for key in ("w1", "a"):
            np.testing.assert_allclose(got["outer"][key], want["outer"][key], rtol=1e-6)


@pytest.mark.parametrize("op", ["gradient", "value_and_gradient", "pullback"])
def test_a_prepared_result_shaped_like_a_flat_dict_keeps_each_array_under_its_key(op):
    p = flat_params()
    seeds = {"cotangent": jnp.asarray(2.0)} if op == "pullback" else {}
    prepared = ad.prepare(getattr(ad, op), flat_f, Active(p), **seeds)
    scale = 2.0 if op == "pullback" else 1.0
    want = jax.tree.map(lambda g: scale * g, jax.grad(flat_f)(p))
    for _ in range(2):
        got = prepared(flat_params(), **seeds)
        got = got[1] if op == "value_and_gradient" else got
        assert list(got) == list(p)
        for key in p:
            assert got[key].shape == p[key].shape
            np.testing.assert_allclose(got[key], want[key], rtol=1e-6)


def nest(outer, inner):
    """``outer`` with each leaf replaced by ``inner``, in ``outer``'s key order (jacobian layout)."""
    if isinstance(outer, dict):
        return {key: nest(value, inner) for key, value in outer.items()}
    return inner


def tangent_like(p, scale=1.0):
    return jax.tree.map(lambda leaf: scale * jnp.ones_like(leaf), p)


def cotangent_like(p):
    return {"y": jnp.ones_like(p["w"]["z"]), "c": -jnp.ones(3)}


# (operator, f, op keywords given p, expected result given p (hand-written JAX), expected key order given p)
ORDER_CASES = [
    pytest.param(
        ad.gradient, scalar_f, lambda p: {}, lambda p: jax.jit(jax.grad(scalar_f))(p), lambda p: key_order(p),
        id="gradient",
    ),
    pytest.param(
        ad.value_and_gradient, scalar_f, lambda p: {},
        lambda p: jax.jit(jax.value_and_grad(scalar_f))(p), lambda p: key_order((0.0, p)),
        id="value_and_gradient",
    ),
    pytest.param(
        ad.gradient, aux_f, lambda p: {"has_aux": True},
        lambda p: (jax.grad(scalar_f)(p), {"n": p["a"] * 2, "b": jnp.sum(p["w"]["z"])}),
        lambda p: key_order((p, {"s": 0, "n": 0, "b": 0})),
        id="gradient-aux",
    ),
    pytest.param(
        ad.jacobian, vector_f, lambda p: {}, lambda p: jax.jit(jax.jacrev(vector_f))(p),
        lambda p: key_order({"y": p, "c": p}), id="jacobian",
    ),
    pytest.param(
        ad.hessian, scalar_f, lambda p: {}, lambda p: jax.jit(jax.hessian(scalar_f))(p),
        lambda p: key_order(nest(p, p)), id="hessian",
    ),
    pytest.param(
        ad.hvp, scalar_f, lambda p: {"tangent": tangent_like(p)},
        lambda p: jax.jvp(jax.grad(scalar_f), (p,), (tangent_like(p),))[1], lambda p: key_order(p), id="hvp",
    ),
    pytest.param(
        ad.gradient_and_hvp, scalar_f, lambda p: {"tangents": [tangent_like(p), tangent_like(p, -2.0)]},
        lambda p: (
            jax.grad(scalar_f)(p),
            [jax.jvp(jax.grad(scalar_f), (p,), (tangent_like(p, s),))[1] for s in (1.0, -2.0)],
        ),
        lambda p: key_order((p, [p, p])), id="gradient_and_hvp",
    ),
    pytest.param(
        ad.pushforward, vector_f, lambda p: {"tangent": tangent_like(p)},
        lambda p: jax.jvp(vector_f, (p,), (tangent_like(p),))[1], lambda p: key_order({"y": 0, "c": 0}),
        id="pushforward",
    ),
    pytest.param(
        ad.pullback, vector_f, lambda p: {"cotangent": cotangent_like(p)},
        lambda p: jax.vjp(vector_f, p)[1](cotangent_like(p))[0], lambda p: key_order(p), id="pullback",
    ),
]


def _assert_result(result, p, expected, order, has_aux):
    assert key_order(result) == order(p), f"key order {key_order(result)}, expected {order(p)}"
    if has_aux:
        (grad, aux), (expected_grad, expected_aux) = result, expected(p)
        assert aux["s"] == "text"
        assert_close_by_key(grad, expected_grad)
        assert_close_by_key({k: aux[k] for k in ("n", "b")}, expected_aux)
    else:
        assert_close_by_key(result, expected(p))


@pytest.mark.parametrize("op, f, keywords, expected, order", ORDER_CASES)
def test_results_keep_the_inputs_dict_key_order_in_every_mode(op, f, keywords, expected, order):
    p, p_new = params(2), params(4)  # p_new: another signature (a longer leaf)
    kw = keywords(p)
    options = {k: v for k, v in kw.items() if k == "has_aux"}

    def seeds(q):
        return {k: v for k, v in keywords(q).items() if k != "has_aux"}

    has_aux = bool(options)
    _assert_result(op(f, Active(p), **kw), p, expected, order, has_aux)  # unprepared
    prepared = ad.prepare(op, f, Active(p), **kw)
    for _ in range(3):  # the first call goes through JAX's Python dispatch, the next ones through C++
        _assert_result(prepared(p, **seeds(p)), p, expected, order, has_aux)
    lenient = ad.prepare(op, f, Active(p), strict=False, **kw)
    for q in (p_new, p_new, p, p_new, p):  # a new signature traced in, then both from the compiled call
        _assert_result(lenient(q, **seeds(q)), q, expected, order, has_aux)


@pytest.mark.parametrize("strict", [True, False])
def test_key_order_of_a_model_with_static_leaves_and_of_derivatives(strict):
    """The generic path (a static leaf in the Active) and scalar-input operators keep it too."""
    p = {"w": jnp.asarray(0.5), "mode": "double", "a": jnp.asarray(-1.5)}

    def f(p):
        return (2.0 if p["mode"] == "double" else 1.0) * jnp.sin(p["w"]) * p["a"] ** 2

    expected_d = {"w": 2 * np.cos(0.5) * 1.5**2, "mode": None, "a": 2 * np.sin(0.5) * 2 * -1.5}
    for op in (ad.gradient, ad.derivative):
        prepared = ad.prepare(op, f, Active(p), strict=strict)
        for _ in range(3):
            result = prepared(p)
            assert list(result) == ["w", "mode", "a"]
            assert result["mode"] is None
            np.testing.assert_allclose([result["w"], result["a"]], [expected_d["w"], expected_d["a"]], **TOL)


# ---------------------------------------------------------------- (8) models with non-array leaves


@pytest.fixture
def mlp():
    return eqx.nn.MLP(2, 2, 8, 2, key=jax.random.key(0))  # its activation functions are leaves


def mlp_loss(model, x):
    return jnp.sum(jax.vmap(model)(x) ** 2)


def test_an_equinox_model_with_function_leaves_is_traced_and_compiled_at_prepare(mlp):
    loss, traces = counted(mlp_loss)
    x0 = jnp.zeros((4, 2))
    prepared = ad.prepare(ad.gradient, loss, Active(mlp), Constant(x0))
    assert traces, "prepare did not trace f"
    traced_by_prepare = len(traces)
    rng = np.random.default_rng(0)
    batches = [jnp.asarray(rng.normal(size=(4, 2)), dtype=jnp.float32) for _ in range(3)]
    reference = eqx.filter_jit(eqx.filter_grad(mlp_loss))
    with compilations() as compiled:
        first = prepared(mlp, batches[0])
        jax.block_until_ready(eqx.filter(first, eqx.is_array))
    assert len(traces) == traced_by_prepare, "the first call traced f again"
    assert compiled == [], f"the first call compiled {compiled}"
    for x in batches:
        result = prepared(mlp, x)
        expected = reference(mlp, x)
        assert_same_arrays(result, expected)
        assert result.activation is None and result.final_activation is None  # as filter_grad: no gradient
    assert len(traces) == traced_by_prepare


def test_static_python_values_are_compiled_at_prepare_too():
    f, traces = counted(lambda x, scale, mode: scale * jnp.sum(jnp.sin(x)) * (2.0 if mode == "double" else 1.0))
    prepared = ad.prepare(ad.gradient, f, Active(jnp.zeros(3)), Constant(3.0), Constant("double"))
    traced = len(traces)
    assert traced > 0
    x = jnp.array([0.1, 0.2, 0.3])
    with compilations() as compiled:
        result = prepared(x, 3.0, "double")
    np.testing.assert_allclose(result, 6.0 * np.cos(np.asarray(x)), **TOL)
    assert len(traces) == traced and compiled == []


# ---------------------------------------------------------------- (9) bounded strict=False


def sin_sum(x, c):
    return jnp.sum(jnp.sin(c["x"] * x[:, None]))


def sin_sum_grad(x, c):
    return np.sum(np.asarray(c["x"]) * np.cos(np.asarray(c["x"]) * np.asarray(x)[:, None]), axis=1)


def test_lenient_preparation_keeps_a_bounded_number_of_signatures():
    """Forty batch shapes: right results, at most max_signatures plans and compiled entries."""
    c0 = {"x": jnp.ones((3, 4))}
    prepared = ad.prepare(ad.gradient, sin_sum, Active(jnp.ones(3)), Constant(c0), strict=False, max_signatures=4)
    rng = np.random.default_rng(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the re-preparing warning has its own test
        for n in range(2, 42):
            x = jnp.asarray(rng.normal(size=n), dtype=jnp.float32)
            c = {"x": jnp.asarray(rng.normal(size=(n, 4)), dtype=jnp.float32)}
            np.testing.assert_allclose(prepared(x, c), sin_sum_grad(x, c), **TOL)
            assert len(prepared._plans) <= 4
            assert prepared._compiled_call.call.jitted._cache_size() <= 4  # JAX's compiled entries


def test_lenient_preparation_drops_the_least_recently_used_signature():
    """A Python number in a Constant is static: each value is a signature with its own plan
    and compiled pipeline, so the trace counter shows which were kept."""
    f, traces = counted(lambda x, scale: scale * jnp.sum(jnp.sin(x)))
    x = jnp.array([0.1, 0.2])
    prepared = ad.prepare(ad.gradient, f, Active(x), Constant(1.0), strict=False, max_signatures=3)

    def traced_by(scale):
        before = len(traces)
        np.testing.assert_allclose(prepared(x, scale), scale * np.cos(np.asarray(x)), **TOL)
        return len(traces) - before

    assert traced_by(1.0) == 0  # prepared
    assert traced_by(2.0) > 0 and traced_by(3.0) > 0  # full: 1.0, 2.0, 3.0
    assert traced_by(1.0) == 0  # used again: 2.0 is now the least recently used
    assert traced_by(4.0) > 0  # drops 2.0
    assert traced_by(1.0) == 0 and traced_by(3.0) == 0 and traced_by(4.0) == 0
    assert traced_by(2.0) > 0  # dropped, so prepared again


def test_lenient_preparation_warns_once_naming_what_changed():
    prepared = ad.prepare(ad.gradient, sin_sum, Active(jnp.ones(3)), Constant({"x": jnp.ones((3, 4))}), strict=False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for n in range(4, 24):  # 20 new signatures
            prepared(jnp.ones(n), {"x": jnp.ones((n, 4))})
    messages = activity_warnings(record)
    assert len(messages) == 1, messages
    # the ninth new signature is n = 12; the one before it had n = 11
    assert "argument 0 (Active) at (the argument itself): shape (11,) -> (12,)" in messages[0]
    assert "argument 1 (Constant) at ['x']: shape (11, 4) -> (12, 4)" in messages[0]
    assert "max_signatures=32" in messages[0]
    assert record[0].filename == __file__  # points at the call, not at activity or JAX


def test_python_scalar_constants_are_static_and_arrays_are_traced():
    """The documented decision: a Python number in a Constant is static (a new value is a new
    signature, the warning says to pass jnp.asarray); as a JAX array it is traced."""
    f, traces = counted(lambda x, scale: scale * jnp.sum(x**2))
    x = jnp.array([1.0, -2.0])
    strict = ad.prepare(ad.gradient, f, Active(x), Constant(2.0))
    with pytest.raises(ad.PreparationMismatchError, match=r"argument 1\b.*expected the value 2\.0, got the value 3\.0"):
        strict(x, 3.0)
    with pytest.raises(ad.PreparationMismatchError, match=r"expected the value 2\.0, got the value 2\b"):
        strict(x, 2)  # another type is another signature: f may treat 2 and 2.0 differently
    lenient = ad.prepare(ad.gradient, f, Active(x), Constant(2.0), strict=False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for scale in range(3, 14):
            np.testing.assert_allclose(lenient(x, float(scale)), 2 * scale * np.asarray(x), **TOL)
    (message,) = activity_warnings(record)
    # the ninth new signature is scale 11.0; the one before it was 10.0
    assert "argument 1 (Constant) at (the argument itself): the value 10.0 -> the value 11.0" in message
    assert "jnp.asarray(value)" in message
    traced = ad.prepare(ad.gradient, f, Active(x), Constant(jnp.asarray(2.0)))
    count = len(traces)
    for scale in (3.0, 4.0, 5.0):
        np.testing.assert_allclose(traced(x, jnp.asarray(scale)), 2 * scale * np.asarray(x), **TOL)
    assert len(traces) == count, "a traced Constant retraced f for a new value"


def test_max_signatures_is_checked():
    x = jnp.ones(2)
    with pytest.raises(TypeError, match="max_signatures=.*strict=False"):
        ad.prepare(ad.gradient, lambda x: jnp.sum(x), Active(x), max_signatures=4)
    with pytest.raises(ValueError, match="max_signatures must be a positive int, got 0"):
        ad.prepare(ad.gradient, lambda x: jnp.sum(x), Active(x), strict=False, max_signatures=0)


# ---------------------------------------------------------------- (10) mutable non-array constants


class Config:  # no __eq__: compared by identity
    def __init__(self, scale: float):
        self.scale = scale


class Scale:  # a value type: __eq__ and __hash__
    __slots__ = ("value",)

    def __init__(self, value: float):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, Scale) and other.value == self.value

    def __hash__(self):
        return hash(self.value)


def scaled(x, config):
    return config.scale * jnp.sum(x**2)


def test_a_mutable_config_constant_warns_and_its_changes_in_place_are_not_seen():
    x = jnp.array([1.0, 2.0])
    config = Config(2.0)
    with pytest.warns(UserWarning, match=r"argument 1 \(counting from 0 after f\) \(Constant\) at \['cfg'\] is a Config"):
        prepared = ad.prepare(ad.gradient, lambda x, c: scaled(x, c["cfg"]), Active(x), Constant({"cfg": config}))
    np.testing.assert_allclose(prepared(x, {"cfg": config}), 4 * np.asarray(x), **TOL)
    config.scale = 5.0  # in place: the same object matches itself, so the compiled value stays
    np.testing.assert_allclose(prepared(x, {"cfg": config}), 4 * np.asarray(x), **TOL)
    unprepared = ad.gradient(lambda x, c: scaled(x, c["cfg"]), Active(x), Constant({"cfg": config}))
    np.testing.assert_allclose(unprepared, 10 * np.asarray(x), **TOL)
    with pytest.raises(ad.PreparationMismatchError, match=r"argument 1\b.* at \['cfg'\]: expected the value"):
        prepared(x, {"cfg": Config(5.0)})  # another object: another signature


@pytest.mark.parametrize("backend", ["AutoFiniteDifferences", "AutoTorch"])
def test_backends_that_run_f_each_call_see_the_changed_config(backend):
    config = Config(2.0)
    if backend == "AutoTorch":
        x = torch.tensor([1.0, 2.0])
        f = lambda x, c: c.scale * (x**2).sum()  # noqa: E731
    else:
        x = np.array([1.0, 2.0])
        f = lambda x, c: c.scale * np.sum(x**2)  # noqa: E731
    prepared = ad.prepare(ad.gradient, f, Active(x), Constant(config), backend=getattr(ad, backend)())
    config.scale = 5.0
    np.testing.assert_allclose(np.asarray(prepared(x, config)), 10 * np.asarray(x), rtol=1e-6)


def test_a_value_type_constant_compares_by_value():
    f, traces = counted(lambda x, s: s.value * jnp.sum(x**2))
    x = jnp.array([1.0, 2.0])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        prepared = ad.prepare(ad.gradient, f, Active(x), Constant(Scale(2.0)), strict=False)
    assert activity_warnings(record) == []
    count = len(traces)
    np.testing.assert_allclose(prepared(x, Scale(2.0)), 4 * np.asarray(x), **TOL)  # an equal new object
    assert len(traces) == count
    np.testing.assert_allclose(prepared(x, Scale(3.0)), 6 * np.asarray(x), **TOL)  # another value: seen


def test_a_function_reading_a_captured_numpy_array_warns_unless_read_only():
    def make(table):
        return lambda z: z * table

    x = jnp.ones(3)
    table = np.array([1.0, 2.0, 3.0])
    g = make(table)
    with pytest.warns(UserWarning, match=r"argument 1 .* is a function that reads a numpy array from its closure"):
        prepared = ad.prepare(ad.gradient, lambda x, g: jnp.sum(g(x)), Active(x), Constant(g))
    np.testing.assert_allclose(prepared(x, g), [1.0, 2.0, 3.0], **TOL)
    table *= 10  # what the warning says: the compiled code holds the values it was traced with
    np.testing.assert_allclose(prepared(x, g), [1.0, 2.0, 3.0], **TOL)
    with pytest.raises(ad.PreparationMismatchError, match="expected the value <function"):
        prepared(x, make(table))  # a function is compared by identity: another one is another signature
    frozen = np.array([1.0, 2.0, 3.0])
    frozen.flags.writeable = False
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ad.prepare(ad.gradient, lambda x, g: jnp.sum(g(x)), Active(x), Constant(make(frozen)))
    assert activity_warnings(record) == []


class Scaler:
    """A callable object holding an array: its __call__ reads its own state."""

    def __init__(self, weight):
        self.weight = weight

    def __call__(self, z):
        return self.weight * z

    def apply(self, z):
        return self.weight * z


@pytest.mark.parametrize("as_method", [False, True], ids=["callable object", "bound method"])
def test_a_callable_object_holding_arrays_warns_that_its_changes_in_place_are_not_seen(as_method):
    # A callable passed the check meant for functions (a closure over writable numpy): no warning,
    # and the compiled call kept the weight of its first trace
    x, scaler = jnp.ones(3), Scaler(jnp.array([1.0, 2.0, 3.0]))
    g = scaler.apply if as_method else scaler
    kind = "a method of a Scaler" if as_method else "a Scaler"
    with pytest.warns(UserWarning, match=rf"argument 1 \(counting from 0 after f\) \(Constant\) at \(the argument itself\) is {kind}, which can change in place"):
        prepared = ad.prepare(ad.gradient, lambda x, g: jnp.sum(g(x)), Active(x), Constant(g))
    np.testing.assert_allclose(prepared(x, g), [1.0, 2.0, 3.0], **TOL)
    scaler.weight = jnp.zeros(3)  # what the warning says: the compiled code holds the traced weight
    np.testing.assert_allclose(prepared(x, g), [1.0, 2.0, 3.0], **TOL)
    np.testing.assert_allclose(ad.gradient(lambda x, g: jnp.sum(g(x)), Active(x), Constant(g)), [0.0, 0.0, 0.0], **TOL)


class Mode(enum.Enum):
    PLAIN = 1


def test_common_static_leaves_raise_no_false_alarm(mlp):
    x = jnp.ones((4, 2))
    statics = {
        "name": "plain", "scale": 2.0, "count": 3, "flag": True, "mode": Mode.PLAIN, "dtype": jnp.float32,
        "np_dtype": np.dtype("float32"), "fn": jnp.tanh, "builtin": len, "lambda": lambda z: z,
        "names": ("a", "b"), "none": None,
        # function-like objects of JAX's own, callables without arrays, a method of a frozen module
        "custom_jvp": jax.nn.relu, "jitted": jax.jit(jnp.tanh), "partial": functools.partial(jnp.add, 1.0),
        "method of a frozen module": mlp.__call__, "optax": optax.adam(1e-3).update,
    }
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ad.prepare(ad.gradient, lambda m, x, s: mlp_loss(m, x), Active(mlp), Constant(x), Constant(statics))
    assert activity_warnings(record) == []


def test_a_numpy_array_in_a_constant_is_traced_so_changes_are_seen():
    f, traces = counted(lambda w, data: jnp.sum((data["X"] @ w) ** 2))
    X = np.arange(6.0).reshape(3, 2)
    w = jnp.array([0.5, -1.0])
    prepared = ad.prepare(ad.gradient, f, Active(w), Constant({"X": X}))
    count = len(traces)
    for factor in (1.0, -3.0, 0.5):
        X *= factor  # in place, between calls
        expected = 2 * X.T @ (X @ np.asarray(w))
        np.testing.assert_allclose(prepared(w, {"X": X}), expected, rtol=1e-5)
    assert len(traces) == count


# ---------------------------------------------------------------- (4) placeholders


def ls_loss(p, x, buf):
    buf = buf.at[:].set(x @ p["w"])  # a Cache written then read
    return jnp.sum(jnp.tanh(buf) * p["b"])


def ls_grad(p, x):
    return jax.jit(jax.grad(lambda p, x: jnp.sum(jnp.tanh(x @ p["w"]) * p["b"])))(p, x)


def placeholders():
    p = {"w": S((3, 2), jnp.float32), "b": S((2,), jnp.float32)}
    return p, S((4, 3), jnp.float32), S((4, 2), jnp.float32)


def real_arrays(seed: int):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype=jnp.float32)  # noqa: E731
    return {"w": normal(3, 2), "b": normal(2)}, normal(4, 3), jnp.zeros((4, 2))


@pytest.mark.parametrize("strict", [True, False])
def test_jax_placeholders_prepare_without_data(strict):
    f, traces = counted(ls_loss)
    p_s, x_s, buf_s = placeholders()
    prepared = ad.prepare(ad.gradient, f, Active(p_s), Constant(x_s), Cache(buf_s), strict=strict)
    assert prepared.backend == ad.AutoJAX()  # inferred from the placeholders
    assert traces, "nothing was traced at prepare"
    count = len(traces)
    for seed in range(3):
        p, x, buf = real_arrays(seed)
        result = prepared(p, x, buf)
        assert list(result) == ["w", "b"]
        assert_close_by_key(result, ls_grad(p, x))
    assert len(traces) == count, "a call with the prepared shapes traced f again"
    if strict:
        with pytest.raises(ad.PreparationMismatchError, match=r"argument 1\b.*expected a jax array of shape \(4, 3\)"):
            prepared(p, jnp.ones((5, 3)), buf)
        with pytest.raises(ad.PreparationMismatchError, match=r"argument 0\b.* at \['w'\]: expected a jax array of shape"):
            prepared({"w": jnp.ones((2, 2)), "b": p["b"]}, x, buf)
    else:
        x5, buf5 = jnp.ones((5, 3)), jnp.zeros((5, 2))
        assert_close_by_key(prepared(p, x5, buf5), ls_grad(p, x5))


def test_placeholders_are_refused_outside_prepare():
    p_s, x_s, buf_s = placeholders()
    p, x, buf = real_arrays(0)
    prepared = ad.prepare(ad.gradient, ls_loss, Active(p_s), Constant(x_s), Cache(buf_s))
    with pytest.raises(TypeError, match=r"prepared activity.gradient: argument 0\['b'\] is a jax.ShapeDtypeStruct.*prepare only"):
        prepared(p_s, x, buf)
    with pytest.raises(TypeError, match=r"argument 1 is a jax.ShapeDtypeStruct of shape \(4, 3\).*for prepare only"):
        prepared(p, x_s, buf)
    with pytest.raises(TypeError, match=r"^activity.gradient: argument 0\['b'\] is a jax.ShapeDtypeStruct.*when preparing"):
        ad.gradient(ls_loss, Active(p_s), Constant(x), Cache(buf))
    with pytest.raises(TypeError, match=r"argument 0 is a torch tensor on the meta device.*only when preparing"):
        ad.gradient(lambda w: (w**2).sum(), Active(torch.empty(3, device="meta")))
    with pytest.raises(TypeError, match="mix frameworks"):
        ad.prepare(ad.gradient, ls_loss, Active(p_s), Constant(torch.empty(4, 3, device="meta")), Cache(buf_s))


@pytest.mark.parametrize("op", ["hvp", "pushforward"])
def test_jax_placeholder_tangents(op):
    f = lambda p, x: jnp.sum(jnp.tanh(x @ p["w"]) * p["b"])  # noqa: E731
    p_s, x_s, _ = placeholders()
    prepared = ad.prepare(getattr(ad, op), f, Active(p_s), Constant(x_s), tangent=p_s)
    p, x, _ = real_arrays(1)
    t, _, _ = real_arrays(2)
    inner = jax.grad(f) if op == "hvp" else f
    expected = jax.jvp(lambda q: inner(q, x), (p,), (t,))[1]
    result = prepared(p, x, tangent=t)
    assert_close_by_key(result, expected)
    with pytest.raises(TypeError, match=r"tangent\['b'\] is a jax.ShapeDtypeStruct.*for prepare only"):
        prepared(p, x, tangent=p_s)


def test_an_abstract_equinox_model_is_a_placeholder(mlp):
    """`eqx.filter_eval_shape` makes a model of placeholders with its function leaves."""
    loss, traces = counted(mlp_loss)
    abstract = eqx.filter_eval_shape(eqx.nn.MLP, 2, 2, 8, 2, key=jax.random.key(0))
    prepared = ad.prepare(ad.gradient, loss, Active(abstract), Constant(S((4, 2), jnp.float32)))
    count = len(traces)
    assert count > 0
    x = jnp.asarray(np.random.default_rng(3).normal(size=(4, 2)), dtype=jnp.float32)
    result, expected = prepared(mlp, x), eqx.filter_grad(mlp_loss)(mlp, x)
    assert_same_arrays(result, expected)
    assert len(traces) == count


def test_torch_meta_tensors_prepare_without_running_f():
    f, runs = counted(lambda w, x: torch.tanh(x @ w).pow(2).sum())
    w_meta, x_meta = torch.empty(3, device="meta"), torch.empty(4, 3, device="meta")
    prepared = ad.prepare(ad.gradient, f, Active(w_meta), Constant(x_meta))
    assert prepared.backend == ad.AutoTorch()
    assert runs == [], "prepare ran f on meta tensors"
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        w, x = torch.randn(3, generator=generator), torch.randn(4, 3, generator=generator)
        w_leaf = w.clone().requires_grad_()
        (expected,) = torch.autograd.grad(torch.tanh(x @ w_leaf).pow(2).sum(), w_leaf)
        torch.testing.assert_close(prepared(w, x), expected)
    with pytest.raises(ad.PreparationMismatchError, match=r"argument 1\b.*\(4, 3\).*got a torch tensor of shape \(5, 3\)"):
        prepared(w, torch.ones(5, 3))
    with pytest.raises(TypeError, match=r"argument 0 is a torch tensor on the meta device.*for prepare only"):
        prepared(torch.empty(3, device="meta"), x)


def test_torch_meta_tangent_and_a_first_call_of_another_shape():
    f = lambda w: torch.sin(w).sum()  # noqa: E731
    meta = torch.empty(3, device="meta")
    prepared = ad.prepare(ad.pushforward, f, Active(meta), tangent=meta)
    w, t = torch.tensor([0.1, 0.2, 0.3]), torch.tensor([1.0, -1.0, 2.0])
    torch.testing.assert_close(prepared(w, tangent=t), (torch.cos(w) * t).sum())
    strict = ad.prepare(ad.gradient, f, Active(meta))
    with pytest.raises(ad.PreparationMismatchError, match=r"\(3,\).*meta-device placeholder.*got a torch tensor of shape \(4,"):
        strict(torch.ones(4))

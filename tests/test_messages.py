"""Messages that teach: each test makes a real mistake and checks that the message names the
argument and the fix in a line or two, and that the old, unhelpful wording is gone. Where the
message suggests a fix, the fix is applied and its result compared with a raw-backend answer.
(The catalogue of every mistake, with the user's objects checked intact, is test_mistakes.py.)
"""

from __future__ import annotations

import copy
import re
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import activity as ad
from activity import Active, Constant
from activity._problem import describe_type
from activity.testing import Scenario, test_differentiation
from activity.testing._plugin import plan
from activity.testing._runner import UsageError

J, T, FD = ad.AutoJAX(), ad.AutoTorch(), ad.AutoFiniteDifferences()
JAX_NOTE = "JAX has removed its internal frames"


def raised(call: Callable[[], Any], exc: type[BaseException] = Exception) -> BaseException:
    with pytest.raises(exc) as info:
        call()
    return info.value


def message(call: Callable[[], Any], exc: type[BaseException] = Exception) -> str:
    return str(raised(call, exc))


# ============================================================================ a forgotten has_aux=True


def loss_and_aux_jax(w: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    return jnp.sum(w**2), {"norm": jnp.linalg.norm(w)}


def loss_and_aux_torch(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (w**2).sum(), w.detach() * 2


@pytest.mark.parametrize(
    "f, make, backend, second",
    [
        pytest.param(loss_and_aux_jax, lambda: jnp.array([1.0, 2.0, 3.0]), J, "a dict", id="jax"),
        pytest.param(loss_and_aux_torch, lambda: torch.tensor([1.0, 2.0, 3.0]), T, r"an array of shape \(3,\)", id="torch"),
        pytest.param(loss_and_aux_jax, lambda: jnp.array([1.0, 2.0, 3.0]), FD, "a dict", id="finite-differences"),
    ],
)
def test_forgotten_has_aux_names_the_tuple_and_suggests_has_aux(f, make, backend, second):
    text = message(lambda: ad.gradient(f, Active(make()), backend=backend), ValueError)
    assert "activity.gradient needs f to return a scalar, but it returned a tuple of 2 (a scalar, " in text
    assert re.search(second, text), text
    assert "pass has_aux=True" in text
    assert "pytree of 2 arrays" not in text
    # The fix the message gives: the gradient of the first output, and the aux as f returned it.
    grad, aux = ad.gradient(f, Active(make()), backend=backend, has_aux=True)
    np.testing.assert_allclose(np.asarray(grad), [2.0, 4.0, 6.0], rtol=1e-5)
    assert isinstance(aux, dict if f is loss_and_aux_jax else torch.Tensor)


def test_forgotten_has_aux_in_a_prepared_torch_gradient():
    """The prepared torch gradient runs f on the tape directly: the same message."""
    prep = ad.prepare(ad.gradient, loss_and_aux_torch, Active(torch.ones(3)))
    text = message(lambda: prep(torch.ones(3)), ValueError)
    assert "returned a tuple of 2 (a scalar, an array of shape (3,))" in text and "has_aux=True" in text


def test_has_aux_is_not_suggested_where_it_does_not_apply():
    w = jnp.ones(3)
    # hessian takes no has_aux: the tuple is named, has_aux is not offered
    text = message(lambda: ad.hessian(loss_and_aux_jax, Active(w)), ValueError)
    assert "has_aux" not in text and "returned a tuple of 2 (a scalar, a dict)" in text
    # a first output that is not a scalar: not a (loss, aux) pair
    text = message(lambda: ad.gradient(lambda w: (w, w), Active(w)), ValueError)
    assert "has_aux" not in text and "returned a tuple of 2 (an array of shape (3,), an array of shape (3,))" in text
    # has_aux=True given, and f's output part is itself a pair of a scalar and more
    text = message(lambda: ad.gradient(lambda w: ((jnp.sum(w), w), w), Active(w), has_aux=True), ValueError)
    assert "pass has_aux=True" not in text


# ============================================================================ Active(model.parameters())


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def run(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).sum()


@pytest.mark.parametrize("which", ["parameters", "named_parameters"])
def test_active_parameters_generator_is_refused_naming_active_model(which):
    model, x = mlp(), torch.ones(2, 3)
    generator = getattr(model, which)()
    calls = []

    def f(params: Any, x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return sum(p.sum() for p in params)

    for call in (lambda: ad.gradient(f, Active(generator), Constant(x)),
                 lambda: ad.prepare(ad.gradient, f, Active(generator), Constant(x))):
        text = message(call, TypeError)
        assert f"argument 0 (counting from 0 after f) is Active(model.{which}()), a generator" in text
        assert "read only once" in text and "Pass the module itself, Active(model)" in text
        assert "Constant" not in text  # the old advice was the opposite of the fix
    assert calls == [] and next(generator) is not None  # refused before anything read it
    # The fix: Active(model) differentiates the same parameters, as torch.autograd.grad does.
    grads = ad.gradient(run, Active(model), Constant(x))
    expected = torch.autograd.grad(run(model, x), list(model.parameters()))
    assert list(grads) == [name for name, _ in model.named_parameters()]
    for got, want in zip(grads.values(), expected):
        torch.testing.assert_close(got, want)


def test_a_list_of_parameters_is_differentiated():
    model, x = mlp(), torch.ones(2, 3)
    params = list(model.parameters())

    def f(params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        w1, b1, w2, b2 = params
        return (torch.tanh(x @ w1.T + b1) @ w2.T + b2).sum()

    grads = ad.gradient(f, Active(params), Constant(x))
    expected = torch.autograd.grad(run(model, x), params)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)


def test_any_active_iterator_is_refused_with_a_list_suggested():
    text = message(lambda: ad.gradient(lambda xs: sum(jnp.sum(x) for x in xs), Active(iter([jnp.ones(2)]))), TypeError)
    assert "is Active of a list_iterator, an iterator, which can be read only once" in text
    assert "Pass a list or a tuple" in text


# ============================================================================ a frozen module


def test_fully_frozen_module_names_requires_grad_and_the_fix():
    model, x = mlp(), torch.ones(2, 3)
    model.requires_grad_(False)
    text = message(lambda: ad.gradient(run, Active(model), Constant(x)), TypeError)
    assert "argument 0 (counting from 0 after f) is Active(Sequential)" in text
    assert "every parameter of that torch.nn.Module has requires_grad=False" in text
    assert "only parameters with requires_grad=True are differentiated" in text
    assert "model.requires_grad_(True)" in text
    assert "holds no floating-point value" not in text
    assert all(not p.requires_grad for p in model.parameters())  # the user's flags are left alone
    # The fix, on the user's side: unfreeze, then the gradient is torch's.
    model.requires_grad_(True)
    grads = ad.gradient(run, Active(model), Constant(x))
    for got, want in zip(grads.values(), torch.autograd.grad(run(model, x), list(model.parameters()))):
        torch.testing.assert_close(got, want)


def test_module_without_parameters_is_told_to_be_constant():
    text = message(lambda: ad.gradient(lambda m, x: m(x).sum(), Active(torch.nn.Tanh()), Constant(torch.ones(2))), TypeError)
    assert "is Active(Tanh), a torch.nn.Module without parameters. Mark it Constant(model)." in text


# ============================================================================ one scenario, one backend


def test_differentiation_takes_one_scenario_and_one_backend():
    scenario = Scenario("gradient", lambda w: jnp.sum(jnp.sin(w)), [Active(jnp.array([0.1, 0.2]))],
                        result=jnp.cos(jnp.array([0.1, 0.2])))
    one = test_differentiation([J], scenario)
    assert one.counts() == {"pass": 1, "FAIL": 0, "unsupported": 0}
    assert test_differentiation(J, scenario).table() == one.table() == test_differentiation([J], [scenario]).table()
    assert [p.case.scenario for p in plan(J, scenario)] == [scenario]


def test_differentiation_refuses_what_is_not_a_scenario():
    scenario = Scenario("gradient", lambda w: jnp.sum(w**2), [Active(jnp.ones(2))])
    text = message(lambda: test_differentiation([J], "gradient"), UsageError)
    assert "scenarios must be a Scenario or a list of them" in text and "a str 'gradient'" in text
    text = message(lambda: test_differentiation([J], [scenario, (jnp.sum, jnp.ones(2))]), UsageError)
    assert "scenarios holds a tuple, not a Scenario" in text
    assert "is not iterable" not in message(lambda: test_differentiation([J], 3), UsageError)


# ============================================================================ framework type names


@pytest.mark.parametrize(
    "value, words, old",
    [
        pytest.param(jnp.ones(2), "a jax array", "ArrayImpl", id="jax"),
        pytest.param(np.ones(2), "a numpy array", "ndarray", id="numpy"),
        pytest.param(np.float32(1.0), "a numpy float32 scalar", "unannotated float32", id="numpy-scalar"),
        pytest.param(torch.ones(2), "a torch tensor", "Tensor", id="torch"),
        pytest.param(torch.nn.Parameter(torch.ones(2)), "a torch.nn.Parameter", "unannotated Parameter", id="parameter"),
        pytest.param(torch.nn.Linear(2, 2), "a torch.nn.Linear", "unannotated Linear", id="module"),
        pytest.param(2, "a Python int", "unannotated int", id="int"),
        pytest.param({"w": 1.0}, "a dict", "unannotated dict", id="dict"),
    ],
)
def test_unannotated_argument_is_named_in_its_framework_words(value, words, old):
    text = message(lambda: ad.gradient(lambda w, v: jnp.sum(w), Active(jnp.ones(2)), value), TypeError)
    assert f"argument 1 (counting from 0 after f) is unannotated: {words}. Wrap it as Active(x)" in text
    assert old not in text


def test_type_names_of_a_user_module_and_of_a_tracer():
    class Net(torch.nn.Module):
        pass

    assert describe_type(Net()) == "a torch.nn.Module (Net)"
    seen = []
    jax.jit(lambda x: seen.append(describe_type(x)) or x)(jnp.ones(2))
    assert seen == ["a jax array"]


def test_scenario_and_check_name_the_framework_type():
    with pytest.raises(TypeError, match=r"argument 0 is unannotated: a jax array; wrap it"):
        Scenario("gradient", jnp.sum, [jnp.ones(2)])
    with pytest.raises(TypeError, match=r"check: argument 0 is unannotated: a torch tensor; wrap it"):
        ad.testing.check(lambda x: x.sum(), torch.ones(2))


# ============================================================================ a module mismatch


def deep_mlp(layers: int = 30) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)])


def test_prepared_module_mismatch_names_the_parameter_in_a_line():
    model, x = deep_mlp(), torch.ones(2, 8)
    prep = ad.prepare(ad.gradient, run, Active(model), Constant(x))
    other = deep_mlp()
    other[17].bias = torch.nn.Parameter(torch.ones(8, dtype=torch.float64))
    text = message(lambda: prep(other, x), ad.PreparationMismatchError)
    assert len(text) < 400, len(text)  # was 9,259 characters: every parameter of both models
    assert "argument 0 (counting from 0 after f)" in text
    assert "the Sequential module differs from the prepared one: parameter '17.bias': expected dtype " \
           "torch.float32, got torch.float64." in text
    assert "'0.weight'" not in text


@pytest.mark.parametrize(
    "change, expected",
    [
        pytest.param(lambda m: m[3].weight.requires_grad_(False), "parameter '3.weight': expected requires_grad True, got False", id="frozen"),
        pytest.param(lambda m: setattr(m[2], "bias", None), "parameter '2.bias' is missing", id="missing"),
        pytest.param(lambda m: m[1].register_buffer("scale", torch.ones(8)), "buffer '1.scale' is new", id="new-buffer"),
        pytest.param(lambda m: setattr(m[0], "weight", torch.nn.Parameter(torch.ones(4, 8))), "parameter '0.weight': expected shape (8, 8), got (4, 8)", id="shape"),
    ],
)
def test_prepared_module_mismatch_says_what_differs(change, expected):
    model, x = deep_mlp(4), torch.ones(2, 8)
    prep = ad.prepare(ad.gradient, run, Active(model), Constant(x))
    other = copy.deepcopy(model)
    change(other)
    text = message(lambda: prep(other, x), ad.PreparationMismatchError)
    assert len(text) < 400, text
    assert expected in text, text


def test_prepared_module_mismatch_of_submodule_types_names_the_submodule():
    def model(act: type) -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(3, 3), act(), torch.nn.Linear(3, 1))

    x = torch.ones(2, 3)
    prep = ad.prepare(ad.gradient, run, Active(model(torch.nn.ReLU)), Constant(x))
    text = message(lambda: prep(model(torch.nn.GELU), x), ad.PreparationMismatchError)
    assert "submodule '1' is a GELU, prepared as a ReLU" in text


def test_strict_false_warning_names_the_module_change_briefly():
    x = torch.ones(2, 8)
    prep = ad.prepare(ad.gradient, run, Active(deep_mlp()), Constant(x), strict=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for width in range(9, 19):
            prep(torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Linear(width, 1)), x)
    texts = [str(w.message) for w in caught if "prepared again" in str(w.message)]
    assert len(texts) == 1 and len(texts[0]) < 900, texts
    assert "parameter '0.weight': expected shape (16, 8), got (17, 8)" in texts[0]


# ============================================================================ floats for Python ints


def test_python_int_tangent_and_cotangent_are_told_to_be_floats():
    text = message(lambda: ad.pushforward(lambda a: a**2, Active(2.0), tangent=2, backend=J), ValueError)
    assert "tangent is a Python int; tangents are floating point: write it as a float (2.0, or float(x))" in text
    assert "astype" not in text
    text = message(lambda: ad.pullback(lambda a: jnp.sum(a**2), Active(jnp.ones(2)), cotangent=1), ValueError)
    assert "cotangent is a Python int" in text and "write it as a float (1.0, or float(x))" in text
    assert "astype" not in text
    text = message(lambda: ad.gradient(lambda n: n**2, Active(3), backend=FD), TypeError)
    assert "write it as a float (3.0, or float(x))" in text
    assert ad.gradient(lambda n: n**2, Active(3.0), backend=FD) == pytest.approx(6.0, rel=1e-6)  # the fix


def test_integer_arrays_are_told_their_own_conversion():
    text = message(lambda: ad.pushforward(lambda a: a**2, Active(jnp.ones(3)), tangent=jnp.arange(3)), ValueError)
    assert "tangent has dtype int32; tangents are floating point: convert it with .astype(float)" in text
    text = message(lambda: ad.pushforward(lambda a: a**2, Active(torch.ones(3)), tangent=torch.arange(3)), ValueError)
    assert "convert it with .float()" in text and "astype" not in text  # torch tensors have no .astype


# ============================================================================ no JAX frames note on activity's errors


def vector(w: jax.Array) -> jax.Array:
    return w**2


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda w: ad.gradient(vector, Active(w)), id="gradient"),
        pytest.param(lambda w: ad.hessian(vector, Active(w)), id="hessian"),
        pytest.param(lambda w: ad.hvp(vector, Active(w), tangent=w), id="hvp"),
        pytest.param(lambda w: ad.gradient(jnp.sum, Active(w), has_aux=True), id="has-aux"),
        pytest.param(lambda w: ad.jacobian(lambda a: "text", Active(w)), id="jacobian-str"),
        pytest.param(lambda w: ad.gradient(vector, Active(w), backend=FD), id="finite-differences"),
        pytest.param(lambda w: ad.hessian(vector, Active(w), backend=ad.SecondOrder(J, J)), id="second-order"),
        pytest.param(lambda w: ad.prepare(ad.gradient, vector, Active(w))(w), id="prepared"),
        pytest.param(lambda w: ad.prepare(ad.gradient, vector, Active(w), strict=False)(jnp.ones(4)), id="prepared-strict-false"),
    ],
)
def test_activity_errors_raised_inside_jax_transforms_carry_no_jax_note(call):
    error = raised(lambda: call(jnp.ones(3)), (TypeError, ValueError))
    assert str(error).startswith("activity.")
    assert not any(JAX_NOTE in note for note in getattr(error, "__notes__", [])), error.__notes__


def test_errors_of_f_keep_their_notes():
    def broken(w: jax.Array) -> jax.Array:
        return jnp.sum(w @ jnp.ones(4))  # JAX's own shape error, inside f

    error = raised(lambda: ad.gradient(broken, Active(jnp.ones(3))), TypeError)
    notes = error.__notes__
    assert notes[0] == "(raised by f inside activity.gradient with backend AutoJAX())"
    assert any(JAX_NOTE in note for note in notes)  # JAX did remove its frames from f's traceback


def test_remove_frames_mode_leaves_no_jax_cause_on_activity_errors():
    before = jax.config.jax_traceback_filtering
    jax.config.update("jax_traceback_filtering", "remove_frames")
    try:
        error = raised(lambda: ad.gradient(vector, Active(jnp.ones(3))), ValueError)
        f_error = raised(lambda: ad.gradient(lambda w: 1 / 0, Active(jnp.ones(3))), ZeroDivisionError)
    finally:
        jax.config.update("jax_traceback_filtering", before)
    assert error.__cause__ is None and not getattr(error, "__notes__", None)
    assert type(f_error.__cause__).__name__ == "UnfilteredStackTrace"  # f's error: as JAX reports it


# ============================================================================ a misspelt where= mask key


def test_a_misspelt_mask_key_is_the_unexpected_one_with_the_close_match_named():
    params = {"w": jnp.array([1.0, 2.0]), "b": jnp.array(3.0)}
    loss = lambda p: jnp.sum(p["w"] * p["b"])  # noqa: E731
    text = message(lambda: ad.gradient(loss, Active(params, where={"ww": True, "b": False})), TypeError)
    assert "argument 0" in text and "where=" in text
    # the user's key is the unexpected one, the value's own key the missing one
    assert "missing ['w']; unexpected ['ww'] (did you mean 'w'?)" in text, text
    assert "missing ['ww']" not in text and "unexpected ['w']" not in text
    # the fix the message names: the gradient of w only
    got = ad.gradient(loss, Active(params, where={"w": True, "b": False}))
    assert got["b"] is None
    np.testing.assert_allclose(got["w"], jax.grad(lambda w: loss({"w": w, "b": params["b"]}))(params["w"]))


def test_a_mask_key_far_from_any_name_gets_no_guess():
    params = {"weight": jnp.ones(2), "bias": jnp.ones(())}
    text = message(lambda: ad.gradient(lambda p: jnp.sum(p["weight"]), Active(params, where={"weight": True, "zzz": False})), TypeError)
    assert "missing ['bias']; unexpected ['zzz']." in text and "did you mean" not in text


def test_a_misspelt_torch_module_mask_key_is_named_with_the_parameter_it_resembles():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    x = torch.randn(5, 3)
    loss = lambda net, x: net(x).sum()  # noqa: E731
    text = message(lambda: ad.gradient(loss, Active(net, where={"0.wieght": True, "0.bias": False, "2": False}), Constant(x)), TypeError)
    assert "the mask key '0.wieght' names no parameter or submodule of the Sequential (did you mean '0.weight'?)" in text
    assert "says nothing about" not in text  # the misspelling, not its consequence, is what is told
    got = ad.gradient(loss, Active(net, where={"0.weight": True, "0.bias": False, "2": False}), Constant(x))
    assert list(got) == ["0.weight"]
    torch.testing.assert_close(got["0.weight"], torch.autograd.grad(loss(net, x), net[0].weight)[0])


def test_a_nested_torch_module_mask_selects_as_the_dotted_one():
    """``{"0": {"weight": True, "bias": False}}`` is ``{"0.weight": True, "0.bias": False}`` (it
    used to select all of "0", the inner dict read as True); a misspelling inside is named too."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    x = torch.randn(5, 3)
    loss = lambda net, x: net(x).sum()  # noqa: E731
    got = ad.gradient(loss, Active(net, where={"0": {"weight": True, "bias": False}, "2": False}), Constant(x))
    assert list(got) == ["0.weight"]
    torch.testing.assert_close(got["0.weight"], torch.autograd.grad(loss(net, x), net[0].weight)[0])
    text = message(lambda: ad.gradient(loss, Active(net, where={"0": {"bais": False, "weight": True}, "2": False}), Constant(x)), TypeError)
    assert "the mask key '0.bais' names no parameter" in text and "(did you mean '0.bias'?)" in text


# ============================================================================ a list for tangent= is a batch: tangents=


@pytest.mark.parametrize("framework", ["jax", "torch"])
@pytest.mark.parametrize("op", [ad.pushforward, ad.hvp], ids=lambda op: op.__name__)
def test_a_list_passed_as_one_tangent_suggests_tangents(op, framework):
    xp = jnp if framework == "jax" else torch
    x, ts = xp.ones(3), [xp.ones(3), 2 * xp.ones(3)]
    f = lambda x: (x**3).sum()  # noqa: E731
    text = message(lambda: op(f, Active(x), tangent=ts), ValueError)
    assert f"activity.{op.__name__}: tangent is a list; it must be a float array of shape (3,)." in text
    assert "If this list of 2 is a batch of tangents (one result for each), pass it as tangents=[...] instead of tangent=." in text
    batch = op(f, Active(x), tangents=ts)  # the fix: one result per tangent
    assert len(batch) == 2
    for got, t in zip(batch, ts):
        np.testing.assert_allclose(np.asarray(got), np.asarray(op(f, Active(x), tangent=t)), rtol=1e-6)


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_a_list_passed_as_one_cotangent_suggests_cotangents(framework):
    xp = jnp if framework == "jax" else torch
    x, cts = xp.ones(3), [xp.ones(3), 2 * xp.ones(3)]
    text = message(lambda: ad.pullback(lambda x: x**2, Active(x), cotangent=cts), ValueError)
    assert "cotangent must have the structure of f's output: a list of 2 at the root where a leaf is expected." in text
    assert "pass it as cotangents=[...] instead of cotangent=." in text
    assert len(ad.pullback(lambda x: x**2, Active(x), cotangents=cts)) == 2


def test_a_list_tangent_of_a_list_valued_active_is_no_batch():
    """A list-valued Active takes a list tangent: valid, and a mistake in it is not told to be a batch."""
    x = [jnp.ones(3), jnp.ones(2)]
    f = lambda p: jnp.sum(p[0] ** 2) + jnp.sum(p[1])  # noqa: E731
    got = ad.pushforward(f, Active(x), tangent=[jnp.ones(3), jnp.ones(2)])
    assert float(got) == pytest.approx(8.0)
    text = message(lambda: ad.pushforward(f, Active(x), tangent=[jnp.ones(2), jnp.ones(2)]), ValueError)
    assert "tangent[0] has shape (2,), expected (3,)" in text and "tangents=" not in text
    two = ad.pushforward(lambda a, b: jnp.sum(a * b), Active(jnp.ones(2)), Active(jnp.ones(2)), tangent=[jnp.ones(2), jnp.ones(2)])
    assert float(two) == pytest.approx(4.0)  # a list of one tangent per Active, as a tuple
    out = ad.pullback(lambda a: [a, 2 * a], Active(jnp.ones(2)), cotangent=[jnp.ones(2), jnp.ones(2)])
    np.testing.assert_allclose(out, [3.0, 3.0])  # f returns a list: a list cotangent


# ============================================================================ jax.grad habits: argnums=, holomorphic=, allow_int=


def test_argnums_is_told_that_annotations_replace_it():
    x, y = jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])
    f = lambda x, y: jnp.sum(x * y)  # noqa: E731
    for call in (lambda: ad.gradient(f, Active(x), Constant(y), argnums=0), lambda: ad.prepare(ad.gradient, f, Active(x), Constant(y), argnums=0)):
        text = message(call, TypeError)
        assert "activity.gradient got the keyword argument argnums=0, a jax.grad option." in text
        assert "Wrap the argument to differentiate in Active(...) and the others in Constant(...)" in text
        assert "activity.gradient(f, Active(x), Constant(y))" in text
    np.testing.assert_allclose(ad.gradient(f, Active(x), Constant(y)), jax.grad(f, argnums=0)(x, y))  # the fix
    # an annotated argnums= is an argument for f, as any annotated keyword
    assert float(ad.gradient(lambda x, argnums: jnp.sum(x) * argnums, Active(x), argnums=Constant(3.0))[0]) == 3.0


@pytest.mark.parametrize("name, value, fix", [("holomorphic", True, "real and imaginary parts"), ("allow_int", True, "get None in the result")])
def test_other_jax_grad_options_are_told_what_activity_does_instead(name, value, fix):
    text = message(lambda: ad.jacobian(lambda x: x**2, Active(jnp.ones(2)), **{name: value}), TypeError)
    assert f"activity.jacobian got the keyword argument {name}=True, a jax.grad option. activity has no {name}=" in text
    assert fix in text and "The options here are backend=, has_aux=." in text


# ============================================================================ structures are told by path, never as a PyTreeSpec


P = {"w": jnp.ones(2), "b": jnp.ones(())}


@pytest.mark.parametrize(
    "call, told",
    [
        pytest.param(lambda: ad.pushforward(lambda p: p["w"], Active(P), tangent={"w": jnp.ones(2), "bb": jnp.ones(())}),
                     "(as its result has): missing ['b']; unexpected ['bb'] (did you mean 'b'?).", id="tangent"),
        pytest.param(lambda: ad.pullback(lambda p: p, Active(P), cotangent={"w": jnp.ones(2)}),
                     "cotangent must have the structure of f's output: missing ['b'].", id="cotangent"),
        pytest.param(lambda: ad.prepare(ad.gradient, lambda p: p["w"].sum(), Active(P))({**P, "c": jnp.ones(())}),
                     "argument 0 (counting from 0 after f): pytree structure changed: unexpected ['c'].", id="prepared"),
        pytest.param(lambda: ad.prepare(ad.pullback, lambda p: p, Active(P), cotangent=P)(P, cotangent={"w": jnp.ones(2)}),
                     "the cotangent's structure changed: missing ['b'].", id="prepared-cotangent"),
        pytest.param(lambda: ad.gradient(lambda p: p["w"].sum(), Active(P, where=[True, False])),
                     "the mask does not have a prefix of the value's structure: a list of 2 at the root where a dict is expected.",
                     id="mask"),
        pytest.param(lambda: ad.testing.assert_tree_allclose({"a": (np.ones(1),)}, {"a": [np.ones(1)]}, rtol=0, atol=0),
                     "pytree structures differ: a tuple of 1 at ['a'] where a list of 1 is expected", id="testing-kit"),
    ],
)
def test_structure_differences_name_paths_not_treespecs(call, told):
    text = message(call)
    assert told in text, text
    assert "PyTreeSpec" not in text


def test_a_strict_false_structure_change_is_told_by_path():
    prep = ad.prepare(ad.gradient, lambda p: p["w"].sum(), Active(P), strict=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(12):
            prep({**P, **{f"extra{i}": jnp.ones(()) for i in range(n + 1)}})
    texts = [str(w.message) for w in caught if "prepared again" in str(w.message)]
    assert texts and all("PyTreeSpec" not in text for text in texts)
    assert "argument 0 (Active): structure changed: unexpected ['extra" in texts[0], texts[0]


def test_structure_difference_reads_as_paths():
    from activity._tree import flatten, structure_difference

    spec = flatten({"layer": {"w": 0, "b": 0}, "rest": (0, 0)})[1]
    assert structure_difference(spec, {"layer": {"w": 0, "bias": 0}, "rest": (0, 0)}) == "missing ['layer']['b']; unexpected ['layer']['bias']"
    assert structure_difference(spec, {"layer": {"w": 0, "b": 0}, "rest": [0, 0]}) == "a list of 2 at ['rest'] where a tuple of 2 is expected"
    assert structure_difference(spec, {"layer": {"w": 0, "b": 0}, "rest": (0, 0, 0)}) == "unexpected ['rest'][2]"
    many = flatten({f"k{i}": 0 for i in range(6)})[1]
    assert structure_difference(many, {}) == "missing ['k0'], ['k1'], ['k2'] and 3 more"
    # a mask (prefix): a bool stands for the whole part below it
    assert structure_difference(spec, {"layr": True, "rest": False}, prefix=True) == "missing ['layer']; unexpected ['layr'] (did you mean 'layer'?)"


# ============================================================================ f and its first argument swapped


def test_swapped_f_and_argument_names_the_mistake():
    loss = lambda x: jnp.sum(x**2)  # noqa: E731
    text = message(lambda: ad.gradient(Active(jnp.ones(3)), loss), TypeError)
    assert text.startswith("activity.gradient: the first argument must be the function f; got an Active(...), ")
    assert "Active(Array([1., 1., 1.], dtype=float32))" in text
    assert "(swapped?)" in text and "pass f first, then its annotated arguments: activity.gradient(f, Active(x), ...)" in text
    np.testing.assert_allclose(ad.gradient(loss, Active(jnp.ones(3))), [2.0, 2.0, 2.0])  # the fix


def test_a_long_repr_is_cut_between_tokens():
    params = {"weights": jnp.ones((30, 30)), "b": jnp.ones(3)}
    text = message(lambda: ad.gradient(Active(params), lambda p: jnp.sum(p["weights"])), TypeError)
    shown = text.split("got an Active(...), ")[1].split(". f seems")[0]
    assert shown.startswith("Active({'weights': Array([[1., 1.,") and shown.endswith("1., ...]])})"), shown
    assert "1. Call" not in text and "\n" not in text


def test_short_repr_cuts_on_token_boundaries():
    from activity._errors import short_repr

    numbers = list(range(1000, 1100))
    shown = short_repr(numbers)
    assert shown.startswith("[1000, 1001,") and shown.endswith(", ...]") and len(shown) <= 64
    assert all(len(token) == 4 for token in shown[1:-6].split(", ")), shown  # no number cut in two
    assert short_repr("x" * 200).endswith("...'")  # one long token: cut, its quote closed
    assert short_repr(lambda x: x) == "<function test_short_repr_cuts_on_token_boundaries.<locals>.<lambda>>"
    assert short_repr({"a": 1}) == "{'a': 1}"


# ============================================================================ a Python float next to arrays in an Active


@pytest.fixture
def fresh_number_warnings(monkeypatch):
    """The warning shows once per call site and structure in a process: each test starts afresh."""
    import activity._problem

    monkeypatch.setattr(activity._problem, "_WARNED_NUMBERS", set())


def number_warnings(call: Callable[[], Any], times: int = 1) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(times):
            call()
    return [str(w.message) for w in caught if "Python float" in str(w.message)]


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_a_python_float_beside_arrays_is_told_once_with_its_path(framework, fresh_number_warnings):
    xp = jnp if framework == "jax" else torch
    loss = lambda p: (p["w"] * p["lr"]).sum()  # noqa: E731
    texts = number_warnings(lambda: ad.gradient(loss, Active({"w": xp.ones(2), "lr": 0.1})), times=3)
    assert len(texts) == 1, texts  # once, though called three times from one place under "always"
    assert "argument 0 (counting from 0 after f) (Active) holds a Python float next to arrays at ['lr'] = 0.1." in texts[0]
    assert "not differentiated and gets None in the result" in texts[0]
    assert "Pass it as its own Constant(...) argument to say so, or as an array (jnp.asarray(x), torch.tensor(x)) to differentiate it." in texts[0]
    # the fixes it names: as an array it is differentiated; as a Constant, nothing is told
    lr = xp.asarray(0.1) if framework == "jax" else torch.tensor(0.1)
    assert float(ad.gradient(loss, Active({"w": xp.ones(2), "lr": lr}))["lr"]) == pytest.approx(2.0)
    assert number_warnings(lambda: ad.gradient(lambda p, lr: (p["w"] * lr).sum(), Active({"w": xp.ones(2)}), Constant(0.1))) == []


def test_a_python_float_in_a_list_beside_arrays_is_told(fresh_number_warnings):
    texts = number_warnings(lambda: ad.gradient(lambda p: jnp.sum(p[0] * p[1]), Active([jnp.ones(2), 0.5])))
    assert len(texts) == 1 and "next to arrays at [1] = 0.5." in texts[0]


def test_hyper_parameters_of_equinox_modules_and_whole_numbers_are_not_told(fresh_number_warnings):
    eqx = pytest.importorskip("equinox")
    model = [eqx.nn.Linear(2, 2, key=jax.random.PRNGKey(0)), eqx.nn.Dropout(0.5)]  # Dropout.p: a float field
    assert number_warnings(lambda: ad.gradient(lambda m: jnp.sum(m[0](jnp.ones(2))), Active(model))) == []
    assert number_warnings(lambda: ad.gradient(lambda m: jnp.sum(m["d"].p * m["w"]), Active({"d": eqx.nn.Dropout(0.5), "w": jnp.ones(2)}))) == []
    assert number_warnings(lambda: ad.gradient(lambda a: a**2, Active(2.0), backend=J)) == []  # a number to differentiate
    assert number_warnings(lambda: ad.gradient(lambda p: jnp.sum(p["w"]), Active({"w": jnp.ones(2), "step": 3}))) == []  # an int

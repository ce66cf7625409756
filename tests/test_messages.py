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

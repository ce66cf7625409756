"""A user's mistake gets an error of the right type that names the argument and says what to do.

Where the mistake is visible from the arguments alone, the error comes before f runs:
those tests count f's calls.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import activity as ad
from activity import Active, Cache, Constant

J = ad.AutoJAX()
FD = ad.AutoFiniteDifferences()
BACKENDS = [pytest.param(J, id="AutoJAX"), pytest.param(FD, id="AutoFiniteDifferences")]


class Counted:
    """f(x, *rest) = sum(x**2), counting its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x, *rest):
        self.calls += 1
        return (jnp if isinstance(x, jax.Array) else np).sum(x**2)


def x_for(backend):
    return jnp.array([1.0, 2.0, 3.0]) if backend is J else np.array([1.0, 2.0, 3.0])


def xp_for(backend):
    return jnp if backend is J else np


# ============================================================================ annotations


@pytest.mark.parametrize("position", [0, 1, 2])
def test_unannotated_argument_names_its_position_and_the_three_wrappers(position):
    f = Counted()
    x = jnp.ones(3)
    args = [Active(x), Constant(x), Constant(x)]
    args[position] = x
    if position == 0:
        args[1] = Active(x)
    with pytest.raises(TypeError, match=rf"argument {position}\b.*unannotated.*Active\(x\).*Constant\(x\).*Cache\(x\)"):
        ad.gradient(f, *args)
    with pytest.raises(TypeError, match=rf"argument {position}\b.*unannotated"):
        ad.prepare(ad.gradient, f, *args)
    assert f.calls == 0


def test_no_active_argument():
    f = Counted()
    with pytest.raises(TypeError, match=r"no argument is Active.*Active\(x\)"):
        ad.gradient(f, Constant(jnp.ones(3)), Cache(jnp.ones(3)))
    with pytest.raises(TypeError, match=r"no arguments for f.*Active\(x\)"):
        ad.gradient(f)
    assert f.calls == 0


@pytest.mark.parametrize("outer, inner", [(Active, Constant), (Constant, Active), (Active, Active), (Cache, Constant)])
def test_nested_annotation(outer, inner):
    with pytest.raises(TypeError, match=rf"{outer.__name__}\({inner.__name__}\(\.\.\.\)\) nests two annotations"):
        outer(inner(jnp.ones(3)))


@pytest.mark.parametrize("not_f", [jnp.ones(3), "f", Active(jnp.ones(3))], ids=["array", "str", "Active"])
def test_first_argument_must_be_callable(not_f):
    with pytest.raises(TypeError, match=r"first argument must be the function f; got .*pass f first.*activity\.gradient\(f, Active\(x\)"):
        ad.gradient(not_f, Active(jnp.ones(3)))


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(np.arange(3), id="int-array"),
        pytest.param(np.array([True, False]), id="bool-array"),
        pytest.param(3, id="python-int"),
        pytest.param({"n": 3, "name": "s", "f": len}, id="dict-without-floats"),
    ],
)
def test_active_without_floating_leaf_suggests_constant(value):
    f = Counted()
    with pytest.raises(TypeError, match=r"argument 1\b.*Active but holds no floating-point value.*Constant\(\.\.\.\)"):
        ad.gradient(f, Active(jnp.ones(3)), Active(value), backend=J)
    assert f.calls == 0


def test_cache_holding_a_non_array_names_the_path():
    with pytest.raises(TypeError, match=r"argument 1\b.*Cache holding a str at \['b'\].*Constant"):
        ad.gradient(Counted(), Active(jnp.ones(3)), Cache({"a": jnp.ones(2), "b": "text"}))


# ============================================================================ outputs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "op, kwargs",
    [
        pytest.param(ad.gradient, {}, id="gradient"),
        pytest.param(ad.value_and_gradient, {}, id="value_and_gradient"),
        pytest.param(ad.hessian, {}, id="hessian"),
        pytest.param(ad.value_gradient_and_hessian, {}, id="value_gradient_and_hessian"),
        pytest.param(ad.hvp, {"tangent": "x"}, id="hvp"),
        pytest.param(ad.gradient_and_hvp, {"tangents": ["x"]}, id="gradient_and_hvp"),
    ],
)
def test_non_scalar_output_where_a_scalar_is_needed(op, kwargs, backend):
    x = x_for(backend)
    kwargs = {k: ([x] if isinstance(v, list) else x) for k, v in kwargs.items()}
    name = op.__name__
    with pytest.raises(ValueError, match=rf"activity\.{name} needs f to return a scalar.*shape \(3, 2\).*sum\(\).*jacobian"):
        op(lambda x: xp_for(backend).stack([x, x], axis=1), Active(x), backend=backend, **kwargs)
    with pytest.raises(ValueError, match=r"needs f to return a scalar.*pytree of 2 arrays"):
        op(lambda x: {"a": x[0], "b": x[1]}, Active(x), backend=backend, **kwargs)


@pytest.mark.parametrize(
    "out, match",
    [
        pytest.param(lambda x: jnp.arange(3), r"f returned a jax array of dtype int32 at its output.*floating-point", id="int-array"),
        pytest.param(lambda x: "text", r"f returned a str.*floating-point", id="str"),
        pytest.param(lambda x: None, r"f returned None, which holds no array", id="None"),
        pytest.param(lambda x: {"a": jnp.sum(x), "n": 3}, r"f returned a Python int at \['n'\]", id="int-leaf-in-dict"),
    ],
)
def test_non_floating_output(out, match):
    with pytest.raises(TypeError, match=match):
        ad.jacobian(out, Active(jnp.ones(3)))


@pytest.mark.parametrize("op", [ad.derivative, ad.value_and_derivative, ad.second_derivative,
                                ad.value_derivative_and_second_derivative], ids=lambda op: op.__name__)
def test_derivative_of_an_array_active(op):
    f = Counted()
    with pytest.raises(ValueError, match=r"with respect to scalars.*argument 1\b.*shape \(3,\).*jacobian.*pushforward"):
        op(f, Active(jnp.array(1.0)), Active(jnp.ones(3)))
    assert f.calls == 0


# ============================================================================ tangents and cotangents


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", [ad.pushforward, ad.value_and_pushforward, ad.hvp, ad.gradient_and_hvp],
                         ids=lambda op: op.__name__)
def test_tangent_of_the_wrong_shape_names_the_path(op, backend):
    f = Counted()
    x = x_for(backend)
    xp = xp_for(backend)
    p = {"w": x, "b": x[:2]}
    with pytest.raises(ValueError, match=r"tangent has shape \(4,\), expected \(3,\)"):
        op(f, Active(x), tangent=xp.ones(4), backend=backend)
    with pytest.raises(ValueError, match=r"tangent\['b'\] has shape \(3,\), expected \(2,\)"):
        op(lambda p: f(p["w"]) + f(p["b"]), Active(p), tangent={"w": x, "b": x}, backend=backend)
    with pytest.raises(ValueError, match=r"tangents\[1\] has shape \(2,\), expected \(3,\)"):
        op(f, Active(x), tangents=[x, x[:2]], backend=backend)
    with pytest.raises(ValueError, match=r"tangent\[1\] has shape \(2,\), expected \(3,\)"):
        op(lambda a, b: f(a) + f(b), Active(x), Active(x), tangent=(x, x[:2]), backend=backend)
    assert f.calls == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_tangent_of_the_wrong_structure(backend):
    f = Counted()
    x = x_for(backend)
    g = lambda p: f(p["w"]) + f(p["b"])  # noqa: E731
    with pytest.raises(ValueError, match=r"tangent must have the structure of the Active argument 0\b.*missing \['b'\]"):
        ad.pushforward(g, Active({"w": x, "b": x}), tangent={"w": x}, backend=backend)
    with pytest.raises(ValueError, match=r"tangent must have the structure of the Active argument 0\b"):
        ad.pushforward(g, Active({"w": x, "b": x}), tangent=[x, x], backend=backend)
    with pytest.raises(ValueError, match=r"2 Active arguments, tangent must be a tuple with one entry per Active argument"):
        ad.pushforward(lambda a, b: f(a) + f(b), Active(x), Active(x), tangent=x, backend=backend)
    with pytest.raises(ValueError, match=r"2 Active arguments, tangent must be a tuple with one entry per Active argument"):
        ad.pushforward(lambda a, b: f(a) + f(b), Active(x), Active(x), tangent=(x,), backend=backend)
    with pytest.raises(ValueError, match=r"tangent has dtype int.*floating point"):
        ad.pushforward(f, Active(x), tangent=xp_for(backend).arange(3), backend=backend)
    with pytest.raises(ValueError, match=r"tangent is a str"):
        ad.pushforward(f, Active(x), tangent="x", backend=backend)
    assert f.calls == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", [ad.pullback, ad.value_and_pullback], ids=lambda op: op.__name__)
def test_cotangent_of_the_wrong_shape_or_structure(op, backend):
    x = x_for(backend)
    xp = xp_for(backend)
    with pytest.raises(ValueError, match=r"cotangent has shape \(4,\), but f's output there has shape \(3,\)"):
        op(lambda x: x**2, Active(x), cotangent=xp.ones(4), backend=backend)
    with pytest.raises(ValueError, match=r"cotangent must have the structure of f's output: missing \['b'\]\.$"):
        op(lambda x: {"a": x, "b": x}, Active(x), cotangent={"a": x}, backend=backend)
    with pytest.raises(ValueError, match=r"cotangents\[i\] must have the structure of f's output"):
        op(lambda x: {"a": x}, Active(x), cotangents=[x, x], backend=backend)


@pytest.mark.parametrize(
    "op, one, many",
    [
        pytest.param(ad.pushforward, "tangent", "tangents", id="pushforward"),
        pytest.param(ad.value_and_pushforward, "tangent", "tangents", id="value_and_pushforward"),
        pytest.param(ad.hvp, "tangent", "tangents", id="hvp"),
        pytest.param(ad.gradient_and_hvp, "tangent", "tangents", id="gradient_and_hvp"),
        pytest.param(ad.pullback, "cotangent", "cotangents", id="pullback"),
        pytest.param(ad.value_and_pullback, "cotangent", "cotangents", id="value_and_pullback"),
    ],
)
def test_seed_keywords_exactly_one_and_non_empty(op, one, many):
    f = Counted()
    x = jnp.ones(3)
    g = f if one == "tangent" else (lambda x: x**2)
    with pytest.raises(TypeError, match=rf"needs exactly one of {one}= .* or {many}= .*got both"):
        op(g, Active(x), **{one: x, many: [x]})
    with pytest.raises(TypeError, match=rf"needs exactly one of {one}= .* or {many}= .*got neither"):
        op(g, Active(x))
    with pytest.raises(ValueError, match=rf"{many}= must be a non-empty list of {one}s, got a list of length 0"):
        op(g, Active(x), **{many: []})
    with pytest.raises(ValueError, match=rf"{many}= must be a non-empty list"):
        op(g, Active(x), **{many: x})  # an array is not a list of tangents
    assert f.calls == 0


def test_seed_keyword_to_an_operator_without_one():
    with pytest.raises(TypeError, match=r"activity\.gradient got unexpected keyword argument\(s\) \['tangent'\]"):
        ad.prepare(ad.gradient, Counted(), Active(jnp.ones(3)), tangent=jnp.ones(3))


# ============================================================================ backends


@pytest.mark.parametrize(
    "args",
    [
        pytest.param([Active(np.ones(3))], id="numpy"),
        pytest.param([Active(1.5), Constant(2)], id="python-numbers"),
        pytest.param([Active({"a": np.ones(2)}), Constant("s")], id="numpy-pytree"),
    ],
)
def test_numpy_only_needs_an_explicit_backend(args):
    f = Counted()
    with pytest.raises(TypeError, match=r"cannot infer a backend.*AutoJAX\(\).*AutoTorch\(\).*AutoFiniteDifferences\(\)"):
        ad.gradient(f, *args)
    with pytest.raises(TypeError, match=r"cannot infer a backend"):
        ad.prepare(ad.gradient, f, *args)
    assert f.calls == 0


def test_mixing_torch_and_jax_names_both_places():
    f = Counted()
    with pytest.raises(TypeError, match=r"mix frameworks: torch at argument 1\b.*JAX at argument 0\b.*one framework"):
        ad.gradient(f, Active(jnp.ones(3)), Constant(torch.ones(3)))
    with pytest.raises(TypeError, match=r"mix frameworks: torch at argument 0\['t'\].*JAX at argument 1\b"):
        ad.gradient(f, Active({"t": torch.ones(3)}), Active(jnp.ones(3)))
    assert f.calls == 0


def test_autojax_refuses_torch_values():
    with pytest.raises(ad.UnsupportedError, match=r"AutoJAX\(\) cannot differentiate the torch value at argument 1\b.*AutoTorch\(\)"):
        ad.gradient(Counted(), Active(jnp.ones(3)), Constant(torch.ones(3)), backend=J)


@pytest.mark.parametrize("backend", ["jax", ad.AutoJAX, jax, None.__class__], ids=["str", "class", "module", "NoneType"])
def test_backend_must_be_a_backend_object(backend):
    f = Counted()
    with pytest.raises(TypeError, match=r"backend must be a backend object such as backend=AutoJAX\(\), backend=AutoTorch\(\) or backend=AutoFiniteDifferences\(\)"):
        ad.gradient(f, Active(jnp.ones(3)), backend=backend)
    with pytest.raises(TypeError, match=r"backend must be a backend object"):
        ad.prepare(ad.gradient, f, Active(jnp.ones(3)), backend=backend)
    assert f.calls == 0


def test_second_order_needs_first_order_backends():
    with pytest.raises(TypeError, match=r"SecondOrder\(outer=\.\.\.\) must be a first-order backend.*AutoJAX\(\)"):
        ad.SecondOrder(ad.SecondOrder(J, J), J)
    with pytest.raises(TypeError, match=r"SecondOrder\(inner=\.\.\.\) must be a first-order backend"):
        ad.SecondOrder(J, "jax")


@pytest.mark.parametrize("op", [ad.hessian, ad.second_derivative], ids=lambda op: op.__name__)
def test_ad_over_finite_differences_is_unsupported(op):
    backend = ad.SecondOrder(J, FD)
    with pytest.raises(ad.UnsupportedError, match=rf"SecondOrder\(outer=AutoJAX\(\), inner=AutoFiniteDifferences\(.*activity\.{op.__name__}.*Active"):
        op(Counted(), Active(jnp.array(1.0)), backend=backend)


ADVICE_CASES = [
    pytest.param(J, jnp.ones(2), id="AutoJAX"),
    pytest.param(ad.AutoTorch(), torch.ones(2), id="AutoTorch"),
    pytest.param(ad.AutoFiniteDifferences(step=0.05), np.ones(2), id="AutoFiniteDifferences"),
    pytest.param(ad.SecondOrder(ad.AutoTorch(), ad.AutoTorch(), mode="reverse-over-reverse"), torch.ones(2), id="SecondOrder"),
]


@pytest.mark.parametrize("backend, x", ADVICE_CASES)
def test_unsupported_advice_is_a_call_that_runs(backend, x, monkeypatch):
    """The advice names the backend's own repr, which evaluates for every backend; the class name
    alone does not (``SecondOrder().capabilities()`` is a TypeError: it needs outer and inner)."""
    # No built-in first-order backend refuses anything: make its class refuse hessian.
    refuses = lambda self, operator, kind, mode="unprepared": operator != "hessian"  # noqa: E731
    monkeypatch.setattr(type(backend), "supports", refuses)
    with pytest.raises(ad.UnsupportedError) as caught:
        ad.hessian(lambda x: (x**2).sum(), Active(x), backend=backend)
    advice = re.search(r"See the support table: (.+)\.$", str(caught.value)).group(1)
    assert eval(advice, vars(ad)) == backend.capabilities()
    assert backend.capabilities()[("hessian", "active", "unprepared")] is False


def test_unsupported_advice_of_a_backend_that_refuses_runs():
    with pytest.raises(ad.UnsupportedError) as caught:
        ad.hessian(Counted(), Active(jnp.array(1.0)), backend=ad.SecondOrder(J, FD))
    advice = re.search(r"See the support table: (.+)\.$", str(caught.value)).group(1)
    assert eval(advice, vars(ad)) == ad.SecondOrder(J, FD).capabilities()


@pytest.mark.parametrize("backend", BACKENDS)
def test_complex_values_are_unsupported(backend):
    f = Counted()
    z = (jnp if backend is J else np).ones(3, dtype=np.complex64)
    with pytest.raises(ad.UnsupportedError, match=r"argument 0\b.*complex value at its root.*real and imaginary"):
        ad.gradient(f, Active(z), backend=backend)
    with pytest.raises(ad.UnsupportedError, match=r"argument 0\b.*complex value at \['z'\]"):
        ad.gradient(f, Active({"x": x_for(backend), "z": z}), backend=backend)
    assert isinstance(ad.UnsupportedError("x"), NotImplementedError)
    assert f.calls == 0


# ============================================================================ has_aux and f's own exceptions


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", [ad.gradient, ad.value_and_gradient, ad.jacobian, ad.value_and_jacobian],
                         ids=lambda op: op.__name__)
def test_has_aux_with_f_returning_a_single_value(op, backend):
    x = x_for(backend)
    with pytest.raises(ValueError, match=rf"activity\.{op.__name__}\(has_aux=True\): f must return a pair \(output, aux\).*drop has_aux=True"):
        op(lambda x: xp_for(backend).sum(x**2), Active(x), backend=backend, has_aux=True)
    with pytest.raises(ValueError, match=r"must return a pair"):
        op(lambda x: (xp_for(backend).sum(x), 1, 2), Active(x), backend=backend, has_aux=True)


def test_has_aux_for_an_operator_without_it():
    with pytest.raises(TypeError, match=r"activity\.hessian does not take has_aux"):
        ad.prepare(ad.hessian, Counted(), Active(jnp.ones(3)), has_aux=True)


class UserError(Exception):
    pass


@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op, kwargs", [
    pytest.param(ad.gradient, {}, id="gradient"),
    pytest.param(ad.jacobian, {}, id="jacobian"),
    pytest.param(ad.hessian, {}, id="hessian"),
    pytest.param(ad.pushforward, {"tangent": True}, id="pushforward"),
])
def test_exception_in_f_propagates_with_a_note(op, kwargs, backend, prepared):
    def f(x):
        raise UserError("bad input", 42)

    x = x_for(backend)
    kwargs = {k: x for k in kwargs}
    with pytest.raises(UserError) as info:
        if prepared:
            ad.prepare(op, f, Active(x), backend=backend, **kwargs)(x, **kwargs)
        else:
            op(f, Active(x), backend=backend, **kwargs)
    error = info.value
    assert type(error) is UserError and error.args == ("bad input", 42)
    notes = getattr(error, "__notes__", [])
    assert any(f"activity.{op.__name__}" in n and repr(backend) in n for n in notes), notes


# ============================================================================ preparation mismatches


def _p():
    return {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}


def _loss(p, x):
    return jnp.sum(p["w"] @ x + p["b"])


MISMATCHES = [
    pytest.param(lambda: ({"w": jnp.ones((2, 2)), "b": jnp.ones(3)}, jnp.ones(2)),
                 r"argument 0\b.* at \['b'\]: expected a jax array of shape \(2,\) and dtype float32, got a jax array of shape \(3,\)",
                 id="shape-in-active"),
    pytest.param(lambda: (_p(), jnp.ones(3)),
                 r"argument 1\b.*expected a jax array of shape \(2,\).*got a jax array of shape \(3,\)", id="shape-in-constant"),
    pytest.param(lambda: ({"w": jnp.ones((2, 2)), "b": jnp.ones(2, jnp.float16)}, jnp.ones(2)),
                 r"argument 0\b.* at \['b'\]: .*dtype float32, got .*dtype float16", id="dtype"),
    pytest.param(lambda: (_p(), torch.ones(2)),
                 r"argument 1\b.*expected a jax array.*got a torch tensor", id="framework"),
    pytest.param(lambda: ({**_p(), "c": jnp.ones(2)}, jnp.ones(2)),
                 r"argument 0\b.*pytree structure changed: unexpected \['c'\]\.",
                 id="structure"),
    pytest.param(lambda: (Constant(_p()), Active(jnp.ones(2))),
                 r"argument 0\b.*prepared as Active, called as Constant", id="kind"),
    pytest.param(lambda: (_p(), Cache(jnp.ones(2))),
                 r"argument 1\b.*prepared as Constant, called as Cache", id="kind-cache"),
    pytest.param(lambda: (_p(),), r"prepared with 2 argument\(s\) after f, called with 1", id="fewer-arguments"),
    pytest.param(lambda: (_p(), jnp.ones(2), jnp.ones(2)), r"prepared with 2 argument\(s\) after f, called with 3",
                 id="more-arguments"),
]


@pytest.mark.parametrize("make_args, match", MISMATCHES)
def test_preparation_mismatch_names_position_path_expected_and_got(make_args, match):
    f = Counted()
    prepared = ad.prepare(ad.gradient, lambda p, x: f(x) + _loss(p, x), Active(_p()), Constant(jnp.ones(2)))
    f.calls = 0  # preparing traces f; the mismatched call below must not run it
    with pytest.raises(ad.PreparationMismatchError, match=match) as info:
        prepared(*make_args())
    assert isinstance(info.value, ValueError)
    # says what to do
    assert "Prepare again" in str(info.value) or "Pass the same arguments" in str(info.value)
    assert f.calls == 0


def test_preparation_mismatch_of_static_constant_and_of_tangents():
    prepared = ad.prepare(ad.gradient, lambda x, s: jnp.sum(x) * s, Active(jnp.ones(2)), Constant(2.0))
    with pytest.raises(ad.PreparationMismatchError, match=r"argument 1\b.*expected the value 2\.0, got the value 3\.0"):
        prepared(jnp.ones(2), 3.0)
    push = ad.prepare(ad.pushforward, lambda x: x * 2, Active(jnp.ones(2)), tangents=[jnp.ones(2)] * 2)
    with pytest.raises(ad.PreparationMismatchError, match=r"prepared for tangents= with 2 entries, called with tangents= with 3 entries"):
        push(jnp.ones(2), tangents=[jnp.ones(2)] * 3)
    with pytest.raises(ad.PreparationMismatchError, match=r"prepared for tangents= with 2 entries, called with tangent="):
        push(jnp.ones(2), tangent=jnp.ones(2))


def test_preparation_mismatch_with_finite_differences():
    prepared = ad.prepare(ad.gradient, lambda x: np.sum(x**2), Active(np.ones(3)), backend=FD)
    with pytest.raises(ad.PreparationMismatchError, match=r"argument 0\b.*dtype float64, got .*dtype float32"):
        prepared(np.ones(3, np.float32))


@pytest.mark.parametrize("make_args, match", [p for p in MISMATCHES if p.id in ("dtype", "structure", "kind", "kind-cache")])
def test_non_strict_reprepares_instead_of_raising(make_args, match):
    prepared = ad.prepare(ad.gradient, _loss, Active(_p()), Constant(jnp.ones(2)), strict=False)
    args = make_args()
    prepared(*args)  # no error; correctness of re-prepared results: test_preparation.py

"""Annotated keyword arguments for f: `ad.gradient(f, Active(x), Constant(d), scale=Constant(2.0))`.

References are raw backend calls (`jax.grad`, `jax.jvp`, `torch.autograd.grad`) on
the function with every argument passed positionally, never activity itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import activity as ad
from activity import Active, Cache, Constant
from activity.testing import (
    Scenario,
    batchify,
    cachify,
    check_scenario,
    closurify,
    constantify,
    parametrize,
    test_differentiation,
)

jax.config.update("jax_enable_x64", False)

X = jnp.array([0.5, -1.0, 2.0])
D = jnp.array([1.0, 2.0, 3.0])
S = jnp.array(1.5)


def loss(x, d, *, scale, shift=0.0):
    return scale * jnp.sum(jnp.sin(x) * d) + shift


def positional(x, d, scale):
    return loss(x, d, scale=scale)


def test_a_constant_keyword_reaches_f_by_name(assert_tree_close):
    got = ad.gradient(loss, Active(X), Constant(D), scale=Constant(S))
    expected = jax.grad(positional)(X, D, S)
    assert_tree_close(got, expected, rtol=1e-6, atol=1e-7)


def test_keyword_actives_join_the_result_after_the_positional_ones_in_the_order_given(assert_tree_close):
    shift = jnp.array(0.25)
    # shift= is given before scale=: the result follows the order of the call, not of f's signature
    g_x, g_shift, g_scale = ad.gradient(loss, Active(X), Constant(D), shift=Active(shift), scale=Active(S))
    raw = jax.grad(lambda x, shift, scale: loss(x, D, scale=scale, shift=shift), argnums=(0, 1, 2))(X, shift, S)
    assert_tree_close((g_x, g_shift, g_scale), raw, rtol=1e-6, atol=1e-7)


def test_tangents_and_cotangents_follow_the_same_order(assert_tree_close):
    f = lambda x, *, w: jnp.tanh(x * w)  # noqa: E731
    t_x, t_w = jnp.array([1.0, 0.0, -1.0]), jnp.array([0.5, 0.5, 0.5])
    got = ad.pushforward(f, Active(X), w=Active(D), tangent=(t_x, t_w))
    _, expected = jax.jvp(lambda x, w: f(x, w=w), (X, D), (t_x, t_w))
    assert_tree_close(got, expected, rtol=1e-6, atol=1e-7)
    ct = jnp.array([1.0, 2.0, 3.0])
    pulled = ad.pullback(f, Active(X), w=Active(D), cotangent=ct)
    _, vjp = jax.vjp(lambda x, w: f(x, w=w), X, D)
    assert_tree_close(pulled, vjp(ct), rtol=1e-6, atol=1e-7)
    hv = ad.hvp(lambda x, *, w: jnp.sum(f(x, w=w) ** 2), Active(X), w=Active(D), tangent=(t_x, t_w))
    scalar = lambda x, w: jnp.sum(f(x, w=w) ** 2)  # noqa: E731
    _, expected_hv = jax.jvp(jax.grad(scalar, argnums=(0, 1)), (X, D), (t_x, t_w))
    assert_tree_close(hv, expected_hv, rtol=1e-5, atol=1e-6)


OPERATORS = {
    "derivative": (lambda a, *, b: jnp.sin(a) * b, "scalar"),
    "value_and_derivative": (lambda a, *, b: jnp.sin(a) * b, "scalar"),
    "second_derivative": (lambda a, *, b: jnp.sin(a) * b, "scalar"),
    "value_derivative_and_second_derivative": (lambda a, *, b: jnp.sin(a) * b, "scalar"),
    "gradient": (lambda a, *, b: jnp.sum(jnp.sin(a) * b), "vector"),
    "value_and_gradient": (lambda a, *, b: jnp.sum(jnp.sin(a) * b), "vector"),
    "jacobian": (lambda a, *, b: jnp.sin(a) * b, "vector"),
    "value_and_jacobian": (lambda a, *, b: jnp.sin(a) * b, "vector"),
    "pushforward": (lambda a, *, b: jnp.sin(a) * b, "vector"),
    "value_and_pushforward": (lambda a, *, b: jnp.sin(a) * b, "vector"),
    "pullback": (lambda a, *, b: jnp.sin(a) * b, "vector"),
    "value_and_pullback": (lambda a, *, b: jnp.sin(a) * b, "vector"),
    "hessian": (lambda a, *, b: jnp.sum(jnp.sin(a) * b), "vector"),
    "value_gradient_and_hessian": (lambda a, *, b: jnp.sum(jnp.sin(a) * b), "vector"),
    "hvp": (lambda a, *, b: jnp.sum(jnp.sin(a) * b), "vector"),
    "gradient_and_hvp": (lambda a, *, b: jnp.sum(jnp.sin(a) * b), "vector"),
}


def _seeds(name: str, a):
    if name in ("pushforward", "value_and_pushforward", "hvp", "gradient_and_hvp"):
        return {"tangent": jnp.ones_like(a)}
    if name in ("pullback", "value_and_pullback"):
        return {"cotangent": jnp.ones_like(a)}
    return {}


@pytest.mark.parametrize("name", sorted(OPERATORS))
@pytest.mark.parametrize("kind", ["constant", "active"])
def test_every_operator_takes_keyword_arguments_like_positional_ones(name, kind, assert_tree_close):
    f, shape = OPERATORS[name]
    a = jnp.array(0.7) if shape == "scalar" else X
    b = jnp.array(2.0) if shape == "scalar" else D
    op = getattr(ad, name)
    wrap = Active if kind == "active" else Constant
    seeds = _seeds(name, a)
    if kind == "active" and seeds:
        seeds = {key: (value, jnp.ones_like(b)) if key == "tangent" else value for key, value in seeds.items()}
    got = op(f, Active(a), b=wrap(b), **seeds)
    expected = op(lambda a, b: f(a, b=b), Active(a), wrap(b), **seeds)  # the same problem, positionally
    assert_tree_close(got, expected, rtol=1e-6, atol=1e-7)
    prep = ad.prepare(op, f, Active(a + 1), b=wrap(b * 3), **seeds)
    assert_tree_close(prep(a, b=b, **seeds), expected, rtol=1e-6, atol=1e-7)
    assert_tree_close(prep(Active(a), b=wrap(b), **seeds), expected, rtol=1e-6, atol=1e-7)


def test_torch_keywords_with_a_cache_written_in_place(assert_tree_close):
    w = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    d = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)

    def f(w, *, data, buffer):
        buffer.copy_(w * data)
        return (buffer**2).sum()

    before = w.clone()
    got = ad.gradient(f, Active(w), data=Constant(d), buffer=Cache(torch.zeros(3, dtype=torch.float64)))
    w_leaf = w.clone().requires_grad_()
    (expected,) = torch.autograd.grad(((w_leaf * d) ** 2).sum(), [w_leaf])
    assert_tree_close(got, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(w, before) and not w.requires_grad
    fd = ad.gradient(f, Active(w), data=Constant(d), buffer=Cache(torch.zeros(3, dtype=torch.float64)),
                     backend=ad.AutoFiniteDifferences())
    assert_tree_close(fd, expected, rtol=1e-7, atol=1e-9)


def test_a_torch_module_as_a_keyword_active(assert_tree_close):
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    g_x, g_net = ad.gradient(lambda x, *, net: net(x).pow(2).sum(), Active(x), net=Active(net))
    x_leaf = x.clone().requires_grad_()
    expected = torch.autograd.grad(net(x_leaf).pow(2).sum(), [x_leaf, net.weight, net.bias])
    assert_tree_close((g_x, g_net), (expected[0], {"weight": expected[1], "bias": expected[2]}), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ prepare


def test_prepared_keywords_by_name_raw_or_annotated_and_in_any_order(assert_tree_close):
    prep = ad.prepare(ad.gradient, loss, Active(X), Constant(D), scale=Constant(S), shift=Active(jnp.array(0.0)))
    new_x, new_d, new_s = X + 1, D * 2, jnp.array(3.0)
    expected = jax.grad(lambda x, shift: loss(x, new_d, scale=new_s, shift=shift), argnums=(0, 1))(new_x, jnp.array(1.0))
    assert_tree_close(prep(new_x, new_d, shift=jnp.array(1.0), scale=new_s), expected, rtol=1e-6, atol=1e-7)
    annotated = prep(Active(new_x), Constant(new_d), scale=Constant(new_s), shift=Active(jnp.array(1.0)))
    assert_tree_close(annotated, expected, rtol=1e-6, atol=1e-7)


def test_a_prepared_call_missing_a_keyword_says_which():
    prep = ad.prepare(ad.gradient, loss, Active(X), Constant(D), scale=Constant(S))
    with pytest.raises(TypeError, match=r"missing the keyword argument\(s\) scale= for f"):
        prep(X, D)


def test_a_changed_keyword_is_a_mismatch_naming_it():
    prep = ad.prepare(ad.gradient, loss, Active(X), Constant(D), scale=Constant(S))
    with pytest.raises(ad.PreparationMismatchError, match=r"keyword argument scale=.*shape \(\).*shape \(2,\)"):
        prep(X, D, scale=jnp.ones(2))
    with pytest.raises(ad.PreparationMismatchError, match=r"keyword argument scale=: prepared as Constant, called as Active"):
        prep(X, D, scale=Active(S))
    with pytest.raises(ad.PreparationMismatchError, match=r"keyword argument\(s\) shift= for f, which it was not prepared with"):
        prep(X, D, scale=S, shift=Constant(S))


def test_strict_false_prepares_again_for_a_changed_keyword(assert_tree_close):
    prep = ad.prepare(ad.gradient, loss, Active(X), Constant(D), strict=False, scale=Constant(S))
    got = prep(X, D, scale=Active(S))
    expected = jax.grad(positional, argnums=(0, 2))(X, D, S)
    assert_tree_close(got, expected, rtol=1e-6, atol=1e-7)


def test_prepared_torch_keywords(assert_tree_close):
    torch.manual_seed(1)
    w, x, scale = torch.randn(3), torch.randn(3), torch.tensor(2.0)
    f = lambda w, *, x, scale: (scale * w * x).sin().sum()  # noqa: E731
    prep = ad.prepare(ad.gradient, f, Active(torch.zeros(3)), x=Constant(torch.ones(3)), scale=Constant(torch.tensor(1.0)))
    w_leaf = w.clone().requires_grad_()
    (expected,) = torch.autograd.grad(f(w_leaf, x=x, scale=scale), [w_leaf])
    assert_tree_close(prep(w, x=x, scale=scale), expected, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ mistakes


def test_an_unannotated_keyword_names_it_and_the_three_wrappers():
    with pytest.raises(TypeError, match=r"\['scale'\].*Active\(x\).*Constant\(x\).*Cache\(x\)"):
        ad.gradient(loss, Active(X), Constant(D), scale=2.0)


@pytest.mark.parametrize(
    "op, typo, meant",
    [
        (ad.pushforward, "tangnet", "tangent"),
        (ad.pullback, "cotangnet", "cotangent"),
        (ad.gradient, "has_axu", "has_aux"),
        (ad.gradient, "backnd", "backend"),
        (ad.hvp, "tangnets", "tangents"),
    ],
)
def test_a_keyword_close_to_an_option_says_did_you_mean(op, typo, meant):
    f = lambda x: jnp.sum(x**2)  # noqa: E731
    with pytest.raises(TypeError, match=rf"\['{typo}'\].*Did you mean {meant}=\?"):
        op(f, Active(X), **{typo: X})


def test_prepare_suggests_strict_for_stict():
    with pytest.raises(TypeError, match=r"\['stict'\].*Did you mean strict=\?"):
        ad.prepare(ad.gradient, lambda x: jnp.sum(x**2), Active(X), stict=False)


def test_a_tangent_to_an_operator_without_one_says_whose_option_it_is():
    with pytest.raises(TypeError, match=r"tangent= is an option of other operators"):
        ad.gradient(lambda x: jnp.sum(x**2), Active(X), tangent=X)


@pytest.mark.parametrize(
    "op, option",
    [(ad.gradient, "backend"), (ad.gradient, "has_aux"), (ad.pushforward, "tangent"), (ad.pullback, "cotangents")],
)
def test_an_annotation_passed_as_an_operator_option_clashes(op, option):
    calls = []
    f = lambda x, **kw: calls.append(1) or jnp.sum(x**2)  # noqa: E731
    with pytest.raises(TypeError, match=rf"{option}= is an option of the operator, but it got Constant"):
        op(f, Active(X), **{option: Constant(X)})
    with pytest.raises(TypeError, match=rf"{option}= is an option of the operator"):
        ad.prepare(op, f, Active(X), **{option: Constant(X)})
    assert calls == []


def test_an_error_inside_the_keyword_names_the_keyword():
    with pytest.raises(TypeError, match=r"keyword argument data= is a Cache holding a str"):
        ad.gradient(lambda x, *, data: jnp.sum(x), Active(X), data=Cache({"a": "text"}))


def test_keywords_alone_are_enough():
    got = ad.gradient(lambda *, x: jnp.sum(x**2), x=Active(X))
    np.testing.assert_allclose(np.asarray(got), 2 * np.asarray(X), rtol=1e-6)


# ------------------------------------------------------------------ the testing kit


def _scenarios():
    f = lambda w, x, *, scale, bias: jnp.sum(jnp.tanh(w * x * scale + bias) ** 2)  # noqa: E731
    w, x = jnp.array([0.3, -0.2, 0.8]), jnp.array([1.0, 2.0, -1.0])
    base = Scenario(
        "gradient", f, (Active(w), Constant(x)),
        kwargs={"scale": Constant(jnp.array(1.5)), "bias": Active(jnp.array(0.1))},
        prep_args=(Active(w + 1), Constant(x * 2)),
        prep_kwargs={"scale": Constant(jnp.array(3.0)), "bias": Active(jnp.array(-0.4))},
        name="keywords",
    )
    jvp = Scenario(
        "pushforward", lambda w, *, x: jnp.sin(w * x), (Active(w),), kwargs={"x": Constant(x)},
        tangent=jnp.ones(3), name="keywords-jvp",
    )
    return [base, jvp]


def test_scenarios_with_keywords_pass_through_every_transform(assert_tree_close):
    base = _scenarios()[0]
    raw = jax.grad(lambda w, bias: base.f(w, base.args[1].value, scale=jnp.array(1.5), bias=bias), argnums=(0, 1))(
        base.args[0].value, jnp.array(0.1)
    )
    assert_tree_close(base.run(ad.AutoJAX()), raw, rtol=1e-6, atol=1e-7)
    closed = closurify(base)
    assert [a.kind for a in closed.args] == ["active"] and list(closed.kwargs) == ["bias"]
    for transformed in (closed, constantify(base), cachify(base), closurify(constantify(base))):
        assert_tree_close(transformed.run(ad.AutoJAX()), raw, rtol=1e-6, atol=1e-7)
        assert_tree_close(transformed.run(ad.AutoJAX(), prepared=True), raw, rtol=1e-6, atol=1e-7)
    batched = batchify(_scenarios()[1])
    assert len(batched.run(ad.AutoJAX())) == 2


def test_test_differentiation_runs_keyword_scenarios_on_every_backend():
    scenarios = _scenarios()
    every = [*scenarios, *closurify(scenarios), *constantify(scenarios), *cachify(scenarios), *batchify(scenarios)]
    report = test_differentiation([ad.AutoJAX(), ad.AutoFiniteDifferences()], every)
    assert not report.failures


def test_a_prepared_operator_that_kept_its_keyword_preparation_values_is_caught():
    seen = []

    class Stale(ad.AutoFiniteDifferences):
        """Runs every call on the first call's data (keyword values included), as a broken
        prepared backend might."""

        def convert_inputs(self, xs, ctx):
            seen.append(ctx)
            return super().convert_inputs(xs, seen[0])

    base = _scenarios()[0]
    # the same positional values to prepare with: only the keywords' preparation values differ
    scenario = Scenario(base.op, base.f, base.args, kwargs=base.kwargs, prep_args=base.args,
                        prep_kwargs=base.prep_kwargs, name="stale-keywords")
    check_scenario(ad.AutoFiniteDifferences(), scenario)
    Scenario(base.op, base.f, base.args, kwargs=base.prep_kwargs).run(Stale())  # what it will keep using
    with pytest.raises(AssertionError, match=r"unprepared: wrong result(.|\n)*\n  prepared: wrong result"):
        check_scenario(Stale(), scenario)


@parametrize([ad.AutoJAX(), ad.AutoFiniteDifferences()], lambda: _scenarios())
def test_the_pytest_plugin_runs_keyword_scenarios(activity_case):
    activity_case.check()


def test_the_lenient_warning_names_a_keyword_that_keeps_changing():
    prep = ad.prepare(ad.gradient, loss, Active(X), Constant(D), strict=False, scale=Constant(1.0))
    with pytest.warns(UserWarning, match=r"keyword argument scale= \(Constant\) at \(the argument itself\): the value"):
        for value in range(2, 12):
            prep(X, D, scale=float(value))

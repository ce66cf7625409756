"""Operators compose: any operator inside ``f`` of another is differentiated by the outer one.

The matrix: each of the 16 operators inside ``f`` of 12 outer operators, prepared or not on
each side, with the inner Active argument on the outer graph (a MAML inner step) or data with
the outer's tensor a Constant (a physics-informed derivative in the input), on PyTorch, JAX and
across ``differentiate_with``. Every cell is compared with the same composition written in the
raw framework: nested ``torch.autograd.grad(create_graph=True)`` (through
``torch.autograd.functional`` for the outer operator) on torch, nested ``jax`` transforms on JAX.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import activity as ad
from activity import Active, Constant

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy


@pytest.fixture
def x64():
    """float64 JAX for one test (the setting is global: left as it was)."""
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)

INNER = (
    "derivative", "value_and_derivative", "second_derivative", "value_derivative_and_second_derivative",
    "gradient", "value_and_gradient", "jacobian", "value_and_jacobian",
    "pushforward", "value_and_pushforward", "pullback", "value_and_pullback",
    "hessian", "value_gradient_and_hessian", "hvp", "gradient_and_hvp",
)
OUTER = (
    "gradient", "value_and_gradient", "jacobian", "value_and_jacobian", "pushforward", "value_and_pushforward",
    "pullback", "value_and_pullback", "hessian", "value_gradient_and_hessian", "hvp", "gradient_and_hvp",
)
SCALAR_INPUT = {"derivative", "value_and_derivative", "second_derivative", "value_derivative_and_second_derivative"}
SCALAR_OUTPUT = {"gradient", "value_and_gradient", "hessian", "value_gradient_and_hessian", "hvp", "gradient_and_hvp"}
TANGENT = {"pushforward", "value_and_pushforward", "hvp", "gradient_and_hvp"}
COTANGENT = {"pullback", "value_and_pullback"}


# ------------------------------------------------------------------ the inner functions, in each framework


def scalar_fn(np_like):
    return lambda a, c: (np_like.sin(a * c) * a).sum() + (a**3).sum() * c.sum()


def vector_fn(np_like):
    return lambda a, c: np_like.tanh(a * c) + a.sum() * c


def of_scalar_fn(np_like):
    return lambda a, c: np_like.sin(a * c) * a + a**3 * c  # a scalar a, a vector out


def inner_function(op, np_like):
    if op in SCALAR_INPUT:
        return of_scalar_fn(np_like)
    return scalar_fn(np_like) if op in SCALAR_OUTPUT else vector_fn(np_like)


def seeds(op, like):
    """The inner operator's tangent or cotangent (a function of the argument's shape)."""
    if op in TANGENT:
        return {"tangent": like(np.array([0.3, -0.7, 1.1]))}
    if op in COTANGENT:
        return {"cotangent": like(np.array([1.3, 0.2, -0.5]))}
    return {}


def squares(result):
    """A scalar of every leaf of an operator's result, not linear in them (so a second outer
    derivative sees the inner result's own derivative)."""
    leaves = [leaf for leaf in _leaves(result)]
    return sum(((i + 1) * leaf**2).sum() for i, leaf in enumerate(leaves))


def _leaves(result):
    if isinstance(result, (tuple, list)):
        for item in result:
            yield from _leaves(item)
    elif isinstance(result, dict):
        for item in result.values():
            yield from _leaves(item)
    else:
        yield result


# ------------------------------------------------------------------ torch: the raw composition


def raw_torch_inner(op, fn, a, c, kw):
    """The inner operator by nested ``torch.autograd.grad(create_graph=True)``."""
    if not a.requires_grad:
        a = a.detach().requires_grad_()
    grad = functools.partial(torch.autograd.grad, create_graph=True, retain_graph=True)
    out = fn(a, c)
    if op in SCALAR_INPUT:
        d1 = torch.stack([grad(o, a)[0] for o in out])
        d2 = torch.stack([grad(d, a)[0] for d in d1])
        return {"derivative": d1, "value_and_derivative": (out, d1), "second_derivative": d2,
                "value_derivative_and_second_derivative": (out, d1, d2)}[op]
    if op in SCALAR_OUTPUT:
        (g,) = grad(out, a)
        h = torch.stack([grad(gi, a)[0] for gi in g])
        hv = h @ kw["tangent"] if "tangent" in kw else None
        return {"gradient": g, "value_and_gradient": (out, g), "hessian": h, "value_gradient_and_hessian": (out, g, h),
                "hvp": hv, "gradient_and_hvp": (g, hv)}[op]
    jac = torch.stack([grad(o, a)[0] for o in out])
    return {"jacobian": jac, "value_and_jacobian": (out, jac),
            "pushforward": jac @ kw["tangent"] if "tangent" in kw else None,
            "value_and_pushforward": (out, jac @ kw["tangent"]) if "tangent" in kw else None,
            "pullback": kw["cotangent"] @ jac if "cotangent" in kw else None,
            "value_and_pullback": (out, kw["cotangent"] @ jac) if "cotangent" in kw else None}[op]


def raw_torch_outer(op, F, w, kw):
    """The outer operator on the raw composition ``F`` by torch.autograd.functional."""
    functional = torch.autograd.functional
    value = F(w)
    (g,) = torch.autograd.grad(F(w), w)
    if op in ("gradient", "jacobian"):
        return g
    if op in ("value_and_gradient", "value_and_jacobian"):
        return value, g
    if op == "pushforward":
        return g @ kw["tangent"]
    if op == "value_and_pushforward":
        return value, g @ kw["tangent"]
    if op == "pullback":
        return kw["cotangent"] * g
    if op == "value_and_pullback":
        return value, kw["cotangent"] * g
    h = functional.hessian(F, w)
    if op == "hessian":
        return h
    if op == "value_gradient_and_hessian":
        return value, g, h
    if op == "hvp":
        return h @ kw["tangent"]
    return g, h @ kw["tangent"]


def outer_seeds(op, like):
    if op in TANGENT:
        return {"tangent": like(np.array([0.5, 1.5, -0.25]))}
    if op in COTANGENT:
        return {"cotangent": like(np.array(1.7))}
    return {}


def t64(array):
    return torch.tensor(array, dtype=torch.float64)


W = np.array([0.4, -1.2, 0.9])
X = np.array([1.1, 0.3, -0.6])


def torch_inner_call(op, on_graph, prepared):
    """``w -> squares(inner op)`` with activity's inner operator: the inner Active is the outer's
    own tensor (``on_graph``) or data, with the outer's tensor a Constant."""
    fn = inner_function(op, torch)
    kw = seeds(op, t64)
    operator = getattr(ad, op)
    x = t64(X)

    def arguments(w):
        if op in SCALAR_INPUT:
            return (0.3 * w.sum(), x) if on_graph else (x[0], w)
        return (w, x) if on_graph else (x, w)

    prep = None
    if prepared:
        a0, c0 = arguments(t64(W) + 1.0)
        prep = ad.prepare(operator, fn, Active(a0), Constant(c0), **kw)

    def activity_F(w):
        a, c = arguments(w)
        result = operator(fn, Active(a), Constant(c), **kw) if prep is None else prep(a, c, **kw)
        return squares(result)

    def raw_F(w):
        a, c = arguments(w)
        return squares(raw_torch_inner(op, fn, a, c, kw))

    return activity_F, raw_F


def assert_close(actual, expected):
    actual, expected = list(_leaves(actual)), list(_leaves(expected))
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        got = np.asarray(got.detach() if isinstance(got, torch.Tensor) else got, dtype=np.float64)
        want = np.asarray(want.detach() if isinstance(want, torch.Tensor) else want, dtype=np.float64)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


CELLS = [(inner, outer) for inner in INNER for outer in OUTER]


@pytest.mark.parametrize("on_graph", [True, False], ids=["inner-active-on-graph", "outer-tensor-constant"])
@pytest.mark.parametrize(("inner", "outer"), CELLS, ids=[f"{i}-in-{o}" for i, o in CELLS])
def test_torch_operator_inside_an_operator(inner, outer, on_graph):
    activity_F, raw_F = torch_inner_call(inner, on_graph, prepared=False)
    w = t64(W).requires_grad_()
    kw = outer_seeds(outer, t64)
    expected = raw_torch_outer(outer, raw_F, w, kw)
    w_user = t64(W)
    got = getattr(ad, outer)(activity_F, Active(w_user), **kw)
    assert_close(got, expected)
    for leaf in _leaves(got):
        assert not leaf.requires_grad  # the outermost result is plain
    assert torch.equal(w_user, t64(W)) and w_user.grad is None


PREPARED = [(i, o) for i in ("gradient", "derivative", "jacobian", "pullback", "hvp", "pushforward", "hessian")
            for o in ("gradient", "value_and_gradient", "pushforward", "hvp", "hessian", "jacobian")]


@pytest.mark.parametrize(("inner_prepared", "outer_prepared"), [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize(("inner", "outer"), PREPARED, ids=[f"{i}-in-{o}" for i, o in PREPARED])
def test_torch_prepared_operator_inside_an_operator(inner, outer, inner_prepared, outer_prepared):
    for on_graph in (True, False):
        activity_F, raw_F = torch_inner_call(inner, on_graph, prepared=inner_prepared)
        w = t64(W).requires_grad_()
        kw = outer_seeds(outer, t64)
        expected = raw_torch_outer(outer, raw_F, w, kw)
        operator = getattr(ad, outer)
        if outer_prepared:
            prep = ad.prepare(operator, activity_F, Active(t64(W) * 2), **kw)
            got = prep(t64(W), **kw)
            again = prep(t64(W), **kw)  # a prepared call's later calls take its fast paths
            assert_close(again, expected)
        else:
            got = operator(activity_F, Active(t64(W)), **kw)
        assert_close(got, expected)


def test_the_issue_example_cubes():
    y = t64([1.0, 2.0, 3.0])
    cubed = lambda z: (z**3).sum()  # noqa: E731
    g = ad.gradient(lambda y: (ad.gradient(cubed, Active(y)) * y).sum(), Active(y))
    assert_close(g, 9 * y**2)
    hv = ad.hvp(lambda y: (ad.gradient(cubed, Active(y)) * y).sum(), Active(y), tangent=torch.ones(3, dtype=torch.float64))
    assert_close(hv, 18 * y)


def test_an_inner_call_outside_any_outer_call_stays_plain():
    """Nesting is what keeps the graph: the same call made on its own, on a tensor that requires
    grad, returns a plain result, and so does a call after the nested ones."""
    w = t64(W).requires_grad_()
    assert not ad.gradient(scalar_fn(torch), Active(w), Constant(t64(X))).requires_grad
    ad.gradient(lambda v: ad.gradient(scalar_fn(torch), Active(v), Constant(t64(X))).sum(), Active(t64(W)))
    assert not ad.gradient(scalar_fn(torch), Active(w), Constant(t64(X))).requires_grad


# ------------------------------------------------------------------ modules


def test_torch_modules_inside_an_operator():
    """MAML's inner step and a PINN's derivative in the input, with the outer call's module view
    as the inner Active or Constant argument; compared with torch.func.functional_call and nested
    autograd on the user's own parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    xs = torch.linspace(-1, 1, 5, dtype=torch.float64)[:, None]
    loss = lambda m, x: (m(x) ** 2).mean()  # noqa: E731

    def maml(m, x):
        g = ad.gradient(loss, Active(m), Constant(x))
        return sum(((p - 0.1 * g[name]) ** 2).sum() for name, p in m.named_parameters()) + loss(m, x)

    def pinn(m, x):
        residuals = [ad.derivative(lambda s, m: m(s.reshape(1, 1)).sum(), Active(xi[0]), Constant(m)) for xi in x]
        return sum(r**2 for r in residuals)

    def raw(params, body):
        def call(x):
            return torch.func.functional_call(model, params, (x,))

        if body == "maml":
            value = (call(xs) ** 2).mean()
            g = torch.autograd.grad(value, list(params.values()), create_graph=True)
            return sum(((p - 0.1 * gi) ** 2).sum() for p, gi in zip(params.values(), g)) + value
        total = 0
        for xi in xs:
            s = xi[0].detach().requires_grad_()
            (d,) = torch.autograd.grad(call(s.reshape(1, 1)).sum(), s, create_graph=True)
            total = total + d**2
        return total

    before = {k: v.clone() for k, v in model.state_dict().items()}
    for body, F in (("maml", maml), ("pinn", pinn)):
        params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
        flat = list(params.values())
        # (a PINN's residual does not depend on the last bias: a zero gradient)
        expected = dict(zip(params, map(_zero_if_none, torch.autograd.grad(raw(params, body), flat, allow_unused=True), flat)))
        got = ad.gradient(F, Active(model), Constant(xs))
        assert_close(got, expected)
        prepared = ad.prepare(ad.gradient, F, Active(model), Constant(xs))
        assert_close(prepared(model, xs), expected)
        assert_close(prepared(model, xs), expected)
        # the outer hvp through the module (second order of a first-order inner call)
        tangent = {k: torch.ones_like(v) for k, v in params.items()}
        hv = ad.hvp(F, Active(model), Constant(xs), tangent=tangent)
        grads = torch.autograd.grad(raw(params, body), flat, create_graph=True, allow_unused=True)
        live = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]
        second = torch.autograd.grad([grads[i] for i in live], flat, [tangent[list(params)[i]] for i in live], allow_unused=True)
        assert_close(hv, dict(zip(params, map(_zero_if_none, second, flat))))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def _zero_if_none(derivative, like):
    return torch.zeros_like(like) if derivative is None else derivative


# ------------------------------------------------------------------ a user's own tape


def test_create_graph_keeps_the_result_for_a_users_backward():
    """WGAN-GP in a plain torch training loop: the penalty's gradient by
    ``AutoTorch(create_graph=True)``, then the user's own ``backward()``."""
    torch.manual_seed(1)
    critic = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    x = torch.randn(4, 2, dtype=torch.float64)
    twin = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    twin.load_state_dict(critic.state_dict())

    grad_x = ad.gradient(lambda x: critic(x).sum(), Active(x), backend=ad.AutoTorch(create_graph=True))
    assert grad_x.requires_grad
    penalty = ((grad_x.norm(dim=1) - 1) ** 2).mean()
    penalty.backward()

    xr = x.clone().requires_grad_()
    (raw_grad_x,) = torch.autograd.grad(twin(xr).sum(), xr, create_graph=True)
    ((raw_grad_x.norm(dim=1) - 1) ** 2).mean().backward()
    for p, q in zip(critic.parameters(), twin.parameters()):
        assert_close(p.grad, q.grad)
    # the default stays plain
    assert not ad.gradient(lambda x: critic(x).sum(), Active(x)).requires_grad


def test_create_graph_prepared():
    w = t64(W).requires_grad_()
    prep = ad.prepare(ad.gradient, scalar_fn(torch), Active(t64(W)), Constant(t64(X)), backend=ad.AutoTorch(create_graph=True))
    g = prep(w, t64(X))
    (second,) = torch.autograd.grad(g.sum(), w)
    wr = t64(W).requires_grad_()
    (gr,) = torch.autograd.grad(scalar_fn(torch)(wr, t64(X)), wr, create_graph=True)
    (expected,) = torch.autograd.grad(gr.sum(), wr)
    assert_close(second, expected)


# ------------------------------------------------------------------ JAX


def raw_jax_inner(op, fn, a, c, kw):
    out = fn(a, c)
    if op in SCALAR_INPUT:
        d1 = jax.jacfwd(fn)(a, c)
        d2 = jax.jacfwd(jax.jacfwd(fn))(a, c)
        return {"derivative": d1, "value_and_derivative": (out, d1), "second_derivative": d2,
                "value_derivative_and_second_derivative": (out, d1, d2)}[op]
    if op in SCALAR_OUTPUT:
        g, h = jax.grad(fn)(a, c), jax.hessian(fn)(a, c)
        return {"gradient": lambda: g, "value_and_gradient": lambda: (out, g), "hessian": lambda: h,
                "value_gradient_and_hessian": lambda: (out, g, h), "hvp": lambda: h @ kw["tangent"],
                "gradient_and_hvp": lambda: (g, h @ kw["tangent"])}[op]()
    jac = jax.jacobian(fn)(a, c)
    return {"jacobian": lambda: jac, "value_and_jacobian": lambda: (out, jac),
            "pushforward": lambda: jac @ kw["tangent"], "value_and_pushforward": lambda: (out, jac @ kw["tangent"]),
            "pullback": lambda: kw["cotangent"] @ jac, "value_and_pullback": lambda: (out, kw["cotangent"] @ jac)}[op]()


def raw_jax_outer(op, F, w, kw):
    value, g = F(w), jax.grad(F)(w)
    h = jax.hessian(F)(w)
    return {
        "gradient": lambda: g, "jacobian": lambda: g, "value_and_gradient": lambda: (value, g),
        "value_and_jacobian": lambda: (value, g), "pushforward": lambda: g @ kw["tangent"],
        "value_and_pushforward": lambda: (value, g @ kw["tangent"]), "pullback": lambda: kw["cotangent"] * g,
        "value_and_pullback": lambda: (value, kw["cotangent"] * g), "hessian": lambda: h,
        "value_gradient_and_hessian": lambda: (value, g, h), "hvp": lambda: h @ kw["tangent"],
        "gradient_and_hvp": lambda: (g, h @ kw["tangent"]),
    }[op]()


def jax_inner_call(op, on_graph, prepared):
    fn = inner_function(op, jnp)
    kw = seeds(op, jnp.asarray)
    operator = getattr(ad, op)
    x = jnp.asarray(X)

    def arguments(w):
        if op in SCALAR_INPUT:
            return (0.3 * w.sum(), x) if on_graph else (x[0], w)
        return (w, x) if on_graph else (x, w)

    prep = ad.prepare(operator, fn, *map(lambda k, v: k(v), (Active, Constant), arguments(jnp.asarray(W) + 1)), **kw) if prepared else None

    def activity_F(w):
        a, c = arguments(w)
        return squares(operator(fn, Active(a), Constant(c), **kw) if prep is None else prep(a, c, **kw))

    def raw_F(w):
        a, c = arguments(w)
        return squares(raw_jax_inner(op, fn, a, c, kw))

    return activity_F, raw_F


JAX_CELLS = [(i, o) for i in INNER for o in ("gradient", "pushforward", "hvp", "hessian", "jacobian", "pullback")]


@pytest.mark.parametrize(("inner", "outer"), JAX_CELLS, ids=[f"{i}-in-{o}" for i, o in JAX_CELLS])
def test_jax_operator_inside_an_operator(inner, outer, x64):
    for on_graph, inner_prepared in ((True, False), (False, False), (True, True)):
        activity_F, raw_F = jax_inner_call(inner, on_graph, inner_prepared)
        kw = outer_seeds(outer, jnp.asarray)
        expected = raw_jax_outer(outer, raw_F, jnp.asarray(W), kw)
        got = getattr(ad, outer)(activity_F, Active(jnp.asarray(W)), **kw)
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-9, atol=1e-9)


# ------------------------------------------------------------------ across differentiate_with


@pytest.mark.parametrize("inner", ["gradient", "derivative", "jacobian", "pullback", "hvp"])
def test_jax_differentiates_a_torch_function_that_calls_an_operator(inner, x64):
    """``jax.grad`` of ``differentiate_with(g, AutoTorch())`` where ``g`` itself calls an activity
    operator on torch: AutoTorch's derivative of g differentiates the inner call."""
    torch_F, raw_torch_F = torch_inner_call(inner, on_graph=True, prepared=False)
    h = ad.differentiate_with(torch_F, ad.AutoTorch())
    got = jax.grad(h)(jnp.asarray(W))
    w = t64(W).requires_grad_()
    (expected,) = torch.autograd.grad(raw_torch_F(w), w)
    np.testing.assert_allclose(np.asarray(got), expected.numpy(), rtol=1e-9, atol=1e-9)


def test_the_raw_reference_is_not_the_first_order_answer():
    """The matrix could pass by accident if an inner derivative's own derivative were zero:
    the first-order answer (the inner result detached) differs from the reference."""
    activity_F, raw_F = torch_inner_call("gradient", on_graph=True, prepared=False)
    w = t64(W).requires_grad_()
    (full,) = torch.autograd.grad(raw_F(w), w)

    def detached(w):
        (g,) = torch.autograd.grad(scalar_fn(torch)(w, t64(X)), w, create_graph=True)
        return squares(g.detach())

    w2 = t64(W).requires_grad_()
    assert not torch.allclose(full, torch.zeros(3, dtype=torch.float64))
    with pytest.raises(RuntimeError):  # no graph from the detached inner gradient back to w
        torch.autograd.grad(detached(w2), w2)


# ------------------------------------------------------------------ finite differences


def test_finite_differences_over_a_function_that_calls_autotorch():
    w = t64(W)
    cubes = lambda z: (z**3).sum()  # noqa: E731
    g = ad.gradient(lambda w: (ad.gradient(cubes, Active(w)) * w).sum(), Active(w), backend=ad.AutoFiniteDifferences())
    np.testing.assert_allclose(g.numpy(), 9 * W**2, rtol=1e-7)


def test_finite_differences_inside_an_autotorch_operator_is_an_error_not_a_lost_derivative():
    cubes = lambda z: (z**3).sum()  # noqa: E731
    fd = ad.AutoFiniteDifferences()
    with pytest.raises(ad.UnsupportedError, match=r"AutoFiniteDifferences is called inside f of an AutoTorch operator.*backend=AutoTorch\(\)"):
        ad.gradient(lambda w: (ad.gradient(cubes, Active(w), backend=fd) * w).sum(), Active(t64(W)))
    # the same inner call on data the outer pass does not differentiate is fine
    x = t64(X)
    g = ad.gradient(lambda w: (ad.gradient(cubes, Active(x), backend=fd) * w).sum(), Active(t64(W)))
    np.testing.assert_allclose(g.numpy(), 3 * X**2, rtol=1e-7)

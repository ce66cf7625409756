"""`default_scenarios`: every operator on numbers, vectors, matrices, pytrees and several Actives.

Every scenario carries its expected result, derived by hand (the formulas
below, in float64 numpy at the scenario's own values): the finite-difference
reference is checked by the catalogue like any other backend, never compared
with itself.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .._annotations import Active, Constant
from ._compare import to_float64
from ._frameworks import Framework, random
from ._scenario import Scenario


def _functions(fw: Framework) -> dict[str, Callable[..., Any]]:
    """The catalogue's functions, written once for ``fw``'s array module."""
    xp = fw.xp

    def scalar_to_scalar(t: Any) -> Any:
        return xp.sin(t) * t + t**3

    def scalar_to_vector(t: Any) -> Any:
        return fw.stack([xp.sin(t), t**2, xp.exp(t / 2)])

    def two_scalars(s: Any, t: Any) -> Any:
        return fw.stack([xp.sin(s) * t**2, xp.exp(s * t)])

    def vector_to_scalar(x: Any) -> Any:
        return (xp.tanh(x) ** 2).sum() + (x**3).sum() / 3

    def matrix_to_scalar(m: Any) -> Any:
        return xp.sin(m @ m.T).sum()

    def vector_to_vector(x: Any) -> Any:
        return xp.sin(x) * x.sum() + x**2

    def matrix_to_matrix(m: Any) -> Any:
        return xp.tanh(m @ m) + m.T

    def pytree_to_scalar(params: Any, x: Any) -> Any:
        return (xp.tanh(x @ params["w"] + params["b"]) ** 2).sum() + params["scale"][0] ** 2

    def pytree_to_pytree(params: Any, x: Any) -> Any:
        hidden = xp.tanh(x @ params["w"] + params["b"])
        return {"hidden": hidden, "summary": [(hidden**2).sum(), params["scale"][0] * hidden[0]]}

    def several_to_scalar(w: Any, b: Any, x: Any) -> Any:
        return (xp.tanh(x @ w + b) ** 2).sum()

    def several_to_vector(w: Any, b: Any, x: Any) -> Any:
        return xp.sin(x @ w) * b.sum()

    def vector_with_aux(x: Any) -> Any:
        value = (x**2).sum()
        return value, {"value_doubled": 2 * value, "note": "aux is returned untouched"}

    return {f.__name__: f for f in (
        scalar_to_scalar, scalar_to_vector, two_scalars, vector_to_scalar, matrix_to_scalar, vector_to_vector,
        matrix_to_matrix, pytree_to_scalar, pytree_to_pytree, several_to_scalar, several_to_vector, vector_with_aux,
    )}


# -- the derivatives, by hand ---------------------------------------------------------------------
# Each ``jvp`` maps tangents of the Active leaves (a tuple) to tangents of the output leaves (a tuple),
# each ``hvp`` maps tangents of the Active leaves to the Hessian applied to them. Everything is float64
# numpy; Jacobians, Hessians and pullbacks are assembled from these linear maps on basis vectors.


def _jvp_scalar_to_scalar(t: Any, v: Any) -> Any:
    return ((np.cos(t) * t + np.sin(t) + 3 * t**2) * v,)


def _d2_scalar_to_scalar(t: Any) -> Any:
    return -np.sin(t) * t + 2 * np.cos(t) + 6 * t


def _jvp_scalar_to_vector(t: Any, v: Any) -> Any:
    return (np.array([np.cos(t), 2 * t, np.exp(t / 2) / 2]) * v,)


def _d2_scalar_to_vector(t: Any) -> Any:
    return np.array([-np.sin(t), 2.0, np.exp(t / 2) / 4])


def _partials_two_scalars(u: Any, v: Any) -> Any:
    """First and second partial derivatives of ``[sin(u) v**2, exp(u v)]``."""
    e = np.exp(u * v)
    du, dv = np.array([np.cos(u) * v**2, v * e]), np.array([2 * v * np.sin(u), u * e])
    duu = np.array([-np.sin(u) * v**2, v**2 * e])
    duv = np.array([2 * v * np.cos(u), e * (1 + u * v)])
    dvv = np.array([2 * np.sin(u), u**2 * e])
    return (du, dv), ((duu, duv), (duv, dvv))


def _grad_vector_to_scalar(x: Any) -> Any:
    h = np.tanh(x)
    return 2 * h * (1 - h**2) + x**2


def _hvp_vector_to_scalar(x: Any, v: Any) -> Any:
    h = np.tanh(x)
    return ((1 - h**2) * (2 - 6 * h**2) * v + 2 * x * v,)


def _grad_matrix_to_scalar(m: Any) -> Any:
    return 2 * np.cos(m @ m.T) @ m


def _hvp_matrix_to_scalar(m: Any, v: Any) -> Any:
    a = m @ m.T
    return (2 * (-(np.sin(a) * (v @ m.T + m @ v.T)) @ m + np.cos(a) @ v),)


def _jvp_vector_to_vector(x: Any, v: Any) -> Any:
    return (np.cos(x) * v * x.sum() + np.sin(x) * v.sum() + 2 * x * v,)


def _jvp_matrix_to_matrix(m: Any, v: Any) -> Any:
    return ((1 - np.tanh(m @ m) ** 2) * (v @ m + m @ v) + v.T,)


def _tanh_layer(w: Any, b: Any, x: Any) -> Any:
    """``h = tanh(x w + b)``, ``dD/dz`` and ``D = d sum(h**2) / dz``."""
    h = np.tanh(x @ w + b)
    return h, 2 * h * (1 - h**2), (1 - h**2) * (2 - 6 * h**2)


def _grad_several_to_scalar(w: Any, b: Any, x: Any) -> Any:
    _, d, _ = _tanh_layer(w, b, x)
    return x.T @ d, d.sum(0)


def _hvp_several_to_scalar(w: Any, b: Any, x: Any, vw: Any, vb: Any) -> Any:
    _, _, e = _tanh_layer(w, b, x)
    dd = e * (x @ vw + vb)
    return x.T @ dd, dd.sum(0)


def _jvp_pytree_to_pytree(w: Any, b: Any, s: Any, x: Any, vw: Any, vb: Any, vs: Any) -> Any:
    h = np.tanh(x @ w + b)
    dh = (1 - h**2) * (x @ vw + vb)
    return dh, np.asarray(2 * (h * dh).sum()), vs * h[0] + s * dh[0]


def _jvp_several_to_vector(w: Any, b: Any, x: Any, vw: Any, vb: Any) -> Any:
    z = x @ w
    return (np.cos(z) * (x @ vw) * b.sum() + np.sin(z) * vb.sum(),)


def _blocks(linear: Callable[..., tuple[Any, ...]], inputs: tuple[Any, ...]) -> list[list[np.ndarray]]:
    """``blocks[o][i]``: output leaf ``o`` against input leaf ``i`` (shape ``out.shape + in.shape``) of ``linear``."""
    zeros = [np.zeros_like(x) for x in inputs]
    outputs = [np.asarray(y) for y in linear(*zeros)]
    blocks = [[np.zeros(y.shape + x.shape) for x in inputs] for y in outputs]
    for i, x in enumerate(inputs):
        for k in np.ndindex(x.shape):
            basis = [np.zeros_like(z) for z in zeros]
            basis[i][k] = 1.0
            for o, y in enumerate(linear(*basis)):
                blocks[o][i][(...,) + k] = y
    return blocks


def _pull(blocks: list[list[np.ndarray]], cotangents: tuple[Any, ...]) -> tuple[Any, ...]:
    """The cotangents pulled back through the Jacobian ``blocks``: one per input leaf."""
    return tuple(
        sum(np.tensordot(c, blocks[o][i], axes=np.ndim(c)) for o, c in enumerate(cotangents))
        for i in range(len(blocks[0]))
    )


def _params_tree(w: Any, b: Any, scale: Any) -> dict[Any, Any]:
    """A result shaped like the Active params: the int and the name are static, so None."""
    return {"w": w, "b": b, "scale": [scale, None], "name": None}


def default_scenarios(framework: str = "numpy") -> list[Scenario]:
    """Scenarios for every operator, written in ``framework``.

    Inputs are scalars, vectors, matrices and pytrees, with one or several
    Active arguments and Constants; every scenario has ``prep_args`` different
    from its arguments. Every expected result is derived by hand (float64, at
    the scenario's values), so the finite-difference reference is checked too.

    Args:
        framework: ``"numpy"``, ``"jax"`` or ``"torch"``: the arrays and operations the
            scenarios' functions use (the same functions and values in each).

    Returns:
        The scenarios, in the same order and with the same names in every framework.

    >>> from activity.testing import default_scenarios
    >>> scenarios = default_scenarios("numpy")
    >>> len(scenarios) >= 30, scenarios[0].name, round(float(scenarios[0].result), 4)
    (True, 'derivative-scalar_to_scalar', 2.6496)
    """
    fw = Framework(framework)
    a = fw.array
    fns = _functions(fw)
    values = _functions(Framework("numpy"))  # the same functions on the float64 copies: the values

    t, s = a(0.7), a(-0.4)
    x, x_prep = a(random(1, 4, scale=0.5)), a(random(2, 4, scale=0.5))
    m, m_prep = a(random(3, 3, 3, scale=0.5)), a(random(4, 3, 3, scale=0.5))
    data, data_prep = a(random(5, 5, 3, scale=0.5)), a(random(6, 5, 3, scale=0.5))
    params = {"w": a(random(7, 3, 2, scale=0.5)), "b": a(random(8, 2, scale=0.3)), "scale": [a(1.5), 3], "name": "layer"}
    params_prep = {"w": a(random(9, 3, 2)), "b": a(random(10, 2)), "scale": [a(-2.0), 3], "name": "layer"}
    w, b = params["w"], params["b"]
    tangent_x, cotangent_x = a(random(11, 4)), a(random(12, 4))
    tangent_p = {"w": a(random(13, 3, 2)), "b": a(random(14, 2)), "scale": [a(0.5), None], "name": None}
    tangent_several = (w * 0.5, b - 1)
    pytree_cotangent = {"hidden": a(random(15, 5, 2)), "summary": [a(1.0), a(random(16, 2))]}
    cotangent_several = a(random(17, 5, 2))

    # float64 copies of exactly the values the scenarios hold (float32 in JAX and torch)
    n = to_float64
    t_, s_, x_, m_, d_ = n(t), n(s), n(x), n(m), n(data)
    w_, b_, scale_ = n(w), n(b), n(params["scale"][0])
    p_ = {"w": w_, "b": b_, "scale": [scale_, 3], "name": "layer"}
    tx_, cx_ = n(tangent_x), n(cotangent_x)
    tp_ = (n(tangent_p["w"]), n(tangent_p["b"]), n(tangent_p["scale"][0]))
    ts_ = tuple(n(v) for v in tangent_several)

    # -- first and second derivatives of every function ---------------------------------------
    def jac(linear: Callable[..., Any], *inputs: Any) -> list[list[np.ndarray]]:
        return _blocks(linear, inputs)

    def one(value: Any) -> np.ndarray:
        return np.asarray(value, dtype=np.float64)

    d_s2s, d2_s2s = one(_jvp_scalar_to_scalar(t_, 1.0)[0]), one(_d2_scalar_to_scalar(t_))
    d_s2v, d2_s2v = _jvp_scalar_to_vector(t_, 1.0)[0], _d2_scalar_to_vector(t_)
    d_two, d2_two = _partials_two_scalars(t_, s_)

    g_v2s = _grad_vector_to_scalar(x_)
    h_v2s = jac(lambda v: _hvp_vector_to_scalar(x_, v), x_)[0][0]
    g_m2s = _grad_matrix_to_scalar(m_)
    h_m2s = jac(lambda v: _hvp_matrix_to_scalar(m_, v), m_)[0][0]
    g_several = _grad_several_to_scalar(w_, b_, d_)
    h_several = jac(lambda vw, vb: _hvp_several_to_scalar(w_, b_, d_, vw, vb), w_, b_)
    h_several = ((h_several[0][0], h_several[0][1]), (h_several[1][0], h_several[1][1]))  # type: ignore[assignment]
    gw, gb = _grad_several_to_scalar(w_, b_, d_)
    g_p2s = _params_tree(gw, gb, one(2 * scale_))

    def hvp_p2s(vw: Any, vb: Any, vs: Any) -> Any:
        hw, hb = _hvp_several_to_scalar(w_, b_, d_, vw, vb)
        return _params_tree(hw, hb, one(2 * vs))

    def jvp_v2v(v: Any) -> Any:
        return _jvp_vector_to_vector(x_, v)

    def jvp_m2m(v: Any) -> Any:
        return _jvp_matrix_to_matrix(m_, v)

    def jvp_p2p(vw: Any, vb: Any, vs: Any) -> Any:
        return _jvp_pytree_to_pytree(w_, b_, scale_, d_, vw, vb, vs)

    def jvp_s2v(vw: Any, vb: Any) -> Any:
        return _jvp_several_to_vector(w_, b_, d_, vw, vb)

    j_v2v, j_m2m = jac(jvp_v2v, x_)[0][0], jac(jvp_m2m, m_)[0][0]
    j_p2p = jac(jvp_p2p, w_, b_, scale_)
    j_s2v = jac(jvp_s2v, w_, b_)

    def p2p_tree(hidden: Any, total: Any, first: Any) -> dict[Any, Any]:
        return {"hidden": hidden, "summary": [total, first]}

    y_v2v, y_m2m = values["vector_to_vector"](x_), values["matrix_to_matrix"](m_)
    y_p2p = values["pytree_to_pytree"](p_, d_)
    y_p2p = p2p_tree(y_p2p["hidden"], one(y_p2p["summary"][0]), y_p2p["summary"][1])
    y_s2v = values["several_to_vector"](w_, b_, d_)
    value_v2s, value_m2s = one(values["vector_to_scalar"](x_)), one(values["matrix_to_scalar"](m_))
    value_p2s, value_several = one(values["pytree_to_scalar"](p_, d_)), one(values["several_to_scalar"](w_, b_, d_))
    value_aux = one((x_**2).sum())
    aux = {"value_doubled": 2 * value_aux, "note": "aux is returned untouched"}

    jacobians = {
        "vector_to_vector": j_v2v,
        "matrix_to_matrix": j_m2m,
        "pytree_to_pytree": p2p_tree(*(_params_tree(*row) for row in j_p2p)),
        "several_to_vector": (j_s2v[0][0], j_s2v[0][1]),
    }
    outputs = {"vector_to_vector": y_v2v, "matrix_to_matrix": y_m2m, "pytree_to_pytree": y_p2p, "several_to_vector": y_s2v}
    pushforwards = {
        "vector_to_vector": jvp_v2v(tx_)[0],
        "pytree_to_pytree": p2p_tree(*jvp_p2p(*tp_)),
        "several_to_vector": jvp_s2v(*ts_)[0],
    }
    pc_ = (n(pytree_cotangent["hidden"]), *(n(c) for c in pytree_cotangent["summary"]))
    pullbacks = {
        "vector_to_vector": _pull(jac(jvp_v2v, x_), (cx_,))[0],
        "pytree_to_pytree": _params_tree(*_pull(j_p2p, pc_)),
        "several_to_vector": _pull(j_s2v, (n(cotangent_several),)),
    }
    gradients = {
        "vector_to_scalar": (value_v2s, g_v2s),
        "matrix_to_scalar": (value_m2s, g_m2s),
        "pytree_to_scalar": (value_p2s, g_p2s),
        "several_to_scalar": (value_several, g_several),
    }
    hessians = {"vector_to_scalar": h_v2s, "matrix_to_scalar": h_m2s, "several_to_scalar": h_several}
    hvps = {
        "vector_to_scalar": _hvp_vector_to_scalar(x_, tx_)[0],
        "pytree_to_scalar": hvp_p2s(*tp_),
    }

    def S(op: Any, f: Any, args: Any, prep_args: Any, name: Any, **kw: Any) -> Any:
        return Scenario(op, fns[f], args, prep_args=prep_args, name=f"{op}-{name or f}", **kw)

    one_scalar = ((Active(t),), (Active(a(1.3)),))
    two = ((Active(t), Active(s)), (Active(a(0.1)), Active(a(0.9))))
    vec = ((Active(x),), (Active(x_prep),))
    mat = ((Active(m),), (Active(m_prep),))
    tree = ((Active(params), Constant(data)), (Active(params_prep), Constant(data_prep)))
    several = ((Active(w), Active(b), Constant(data)), (Active(2 * w), Active(b + 1), Constant(data_prep)))
    args_of = {
        "vector_to_scalar": vec, "matrix_to_scalar": mat, "pytree_to_scalar": tree, "several_to_scalar": several,
        "vector_to_vector": vec, "matrix_to_matrix": mat, "pytree_to_pytree": tree, "several_to_vector": several,
    }

    scenarios = []
    first = {
        "scalar_to_scalar": (one_scalar, one(values["scalar_to_scalar"](t_)), d_s2s),
        "scalar_to_vector": (one_scalar, values["scalar_to_vector"](t_), d_s2v),
        "two_scalars": (two, values["two_scalars"](t_, s_), d_two),
    }
    for name, (args, value, derivative) in first.items():
        scenarios.append(S("derivative", name, *args, None, result=derivative))
    for name, (args, value, derivative) in first.items():
        scenarios.append(S("value_and_derivative", name, *args, None, result=(value, derivative)))
    second = {"scalar_to_scalar": d2_s2s, "scalar_to_vector": d2_s2v}
    for name, d2 in second.items():
        scenarios.append(S("second_derivative", name, *first[name][0], None, result=d2))
    for name, d2 in second.items():
        args, value, derivative = first[name]
        scenarios.append(S("value_derivative_and_second_derivative", name, *args, None, result=(value, derivative, d2)))
    scenarios.append(S("second_derivative", "two_scalars", *two, None, result=d2_two))

    for op in ("gradient", "value_and_gradient"):
        for name, (value, gradient) in gradients.items():
            scenarios.append(S(op, name, *args_of[name], None, result=gradient if op == "gradient" else (value, gradient)))
        result = (2 * x_, aux) if op == "gradient" else ((value_aux, aux), 2 * x_)
        scenarios.append(S(op, "vector_with_aux", *vec, None, options={"has_aux": True}, result=result))
    for op in ("jacobian", "value_and_jacobian"):
        for name, jacobian in jacobians.items():
            scenarios.append(S(op, name, *args_of[name], None, result=jacobian if op == "jacobian" else (outputs[name], jacobian)))
    tangents = {"vector_to_vector": tangent_x, "pytree_to_pytree": tangent_p, "several_to_vector": tangent_several}
    for op in ("pushforward", "value_and_pushforward"):
        for name, pushed in pushforwards.items():
            result = pushed if op == "pushforward" else (outputs[name], pushed)
            scenarios.append(S(op, name, *args_of[name], None, tangent=tangents[name], result=result))
    cotangents = {"vector_to_vector": cotangent_x, "pytree_to_pytree": pytree_cotangent, "several_to_vector": cotangent_several}
    for op in ("pullback", "value_and_pullback"):
        for name, pulled in pullbacks.items():
            result = pulled if op == "pullback" else (outputs[name], pulled)
            scenarios.append(S(op, name, *args_of[name], None, tangent=cotangents[name], result=result))
    for op in ("hessian", "value_gradient_and_hessian"):
        for name, hessian in hessians.items():
            value, gradient = gradients[name]
            result = hessian if op == "hessian" else (value, gradient, hessian)  # type: ignore[assignment]
            scenarios.append(S(op, name, *args_of[name], None, result=result))
    hvp_tangents = {"vector_to_scalar": tangent_x, "pytree_to_scalar": tangent_p}
    for op in ("hvp", "gradient_and_hvp"):
        for name, product in hvps.items():
            result = product if op == "hvp" else (gradients[name][1], product)
            scenarios.append(S(op, name, *args_of[name], None, tangent=hvp_tangents[name], result=result))
    return scenarios

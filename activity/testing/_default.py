"""`default_scenarios`: every operator on numbers, vectors, matrices, pytrees and several Actives."""

from __future__ import annotations

from .._annotations import Active, Constant
from ._frameworks import Framework, random
from ._scenario import Scenario


def default_scenarios(framework: str = "numpy") -> list[Scenario]:
    """Scenarios for every operator, written in ``framework`` (``"numpy"``, ``"jax"`` or ``"torch"``).

    Inputs are scalars, vectors, matrices and pytrees, with one or several
    Active arguments and Constants; every scenario has ``prep_args`` different
    from its arguments. Expected results come from the reference backend.

    >>> from activity.testing import default_scenarios
    >>> scenarios = default_scenarios("numpy")
    >>> len(scenarios) >= 30, scenarios[0].name
    (True, 'derivative-scalar_to_scalar')
    """
    fw = Framework(framework)
    xp, a = fw.xp, fw.array

    def scalar_to_scalar(t):
        return xp.sin(t) * t + t**3

    def scalar_to_vector(t):
        return fw.stack([xp.sin(t), t**2, xp.exp(t / 2)])

    def two_scalars(s, t):
        return fw.stack([xp.sin(s) * t**2, xp.exp(s * t)])

    def vector_to_scalar(x):
        return (xp.tanh(x) ** 2).sum() + (x**3).sum() / 3

    def matrix_to_scalar(m):
        return xp.sin(m @ m.T).sum()

    def vector_to_vector(x):
        return xp.sin(x) * x.sum() + x**2

    def matrix_to_matrix(m):
        return xp.tanh(m @ m) + m.T

    def pytree_to_scalar(params, x):
        return (xp.tanh(x @ params["w"] + params["b"]) ** 2).sum() + params["scale"][0] ** 2

    def pytree_to_pytree(params, x):
        hidden = xp.tanh(x @ params["w"] + params["b"])
        return {"hidden": hidden, "summary": [(hidden**2).sum(), params["scale"][0] * hidden[0]]}

    def several_to_scalar(w, b, x):
        return (xp.tanh(x @ w + b) ** 2).sum()

    def several_to_vector(w, b, x):
        return xp.sin(x @ w) * b.sum()

    def vector_with_aux(x):
        value = (x**2).sum()
        return value, {"value_doubled": 2 * value, "note": "aux is returned untouched"}

    t, s = a(0.7), a(-0.4)
    x, x_prep = a(random(1, 4, scale=0.5)), a(random(2, 4, scale=0.5))
    m, m_prep = a(random(3, 3, 3, scale=0.5)), a(random(4, 3, 3, scale=0.5))
    data, data_prep = a(random(5, 5, 3, scale=0.5)), a(random(6, 5, 3, scale=0.5))
    params = {"w": a(random(7, 3, 2, scale=0.5)), "b": a(random(8, 2, scale=0.3)), "scale": [a(1.5), 3], "name": "layer"}
    params_prep = {"w": a(random(9, 3, 2)), "b": a(random(10, 2)), "scale": [a(-2.0), 3], "name": "layer"}
    w, b = params["w"], params["b"]
    tangent_x, cotangent_x = a(random(11, 4)), a(random(12, 4))
    tangent_p = {"w": a(random(13, 3, 2)), "b": a(random(14, 2)), "scale": [a(0.5), None], "name": None}

    def S(op, f, args, prep_args, name, **kw):
        return Scenario(op, f, args, prep_args=prep_args, name=f"{op}-{name}", **kw)

    one_scalar = ((Active(t),), (Active(a(1.3)),))
    two = ((Active(t), Active(s)), (Active(a(0.1)), Active(a(0.9))))
    vec = ((Active(x),), (Active(x_prep),))
    mat = ((Active(m),), (Active(m_prep),))
    tree = ((Active(params), Constant(data)), (Active(params_prep), Constant(data_prep)))
    several = ((Active(w), Active(b), Constant(data)), (Active(2 * w), Active(b + 1), Constant(data_prep)))

    scenarios = []
    for op in ("derivative", "value_and_derivative"):
        scenarios += [
            S(op, scalar_to_scalar, *one_scalar, "scalar_to_scalar"),
            S(op, scalar_to_vector, *one_scalar, "scalar_to_vector"),
            S(op, two_scalars, *two, "two_scalars"),
        ]
    for op in ("second_derivative", "value_derivative_and_second_derivative"):
        scenarios += [
            S(op, scalar_to_scalar, *one_scalar, "scalar_to_scalar"),
            S(op, scalar_to_vector, *one_scalar, "scalar_to_vector"),
        ]
    scenarios.append(S("second_derivative", two_scalars, *two, "two_scalars"))
    for op in ("gradient", "value_and_gradient"):
        scenarios += [
            S(op, vector_to_scalar, *vec, "vector_to_scalar"),
            S(op, matrix_to_scalar, *mat, "matrix_to_scalar"),
            S(op, pytree_to_scalar, *tree, "pytree_to_scalar"),
            S(op, several_to_scalar, *several, "several_to_scalar"),
            S(op, vector_with_aux, *vec, "vector_with_aux", options={"has_aux": True}),
        ]
    for op in ("jacobian", "value_and_jacobian"):
        scenarios += [
            S(op, vector_to_vector, *vec, "vector_to_vector"),
            S(op, matrix_to_matrix, *mat, "matrix_to_matrix"),
            S(op, pytree_to_pytree, *tree, "pytree_to_pytree"),
            S(op, several_to_vector, *several, "several_to_vector"),
        ]
    for op in ("pushforward", "value_and_pushforward"):
        scenarios += [
            S(op, vector_to_vector, *vec, "vector_to_vector", tangent=tangent_x),
            S(op, pytree_to_pytree, *tree, "pytree_to_pytree", tangent=tangent_p),
            S(op, several_to_vector, *several, "several_to_vector", tangent=(w * 0.5, b - 1)),
        ]
    pytree_cotangent = {"hidden": a(random(15, 5, 2)), "summary": [a(1.0), a(random(16, 2))]}
    for op in ("pullback", "value_and_pullback"):
        scenarios += [
            S(op, vector_to_vector, *vec, "vector_to_vector", tangent=cotangent_x),
            S(op, pytree_to_pytree, *tree, "pytree_to_pytree", tangent=pytree_cotangent),
            S(op, several_to_vector, *several, "several_to_vector", tangent=a(random(17, 5, 2))),
        ]
    for op in ("hessian", "value_gradient_and_hessian"):
        scenarios += [
            S(op, vector_to_scalar, *vec, "vector_to_scalar"),
            S(op, matrix_to_scalar, *mat, "matrix_to_scalar"),
            S(op, several_to_scalar, *several, "several_to_scalar"),
        ]
    for op in ("hvp", "gradient_and_hvp"):
        scenarios += [
            S(op, vector_to_scalar, *vec, "vector_to_scalar", tangent=tangent_x),
            S(op, pytree_to_scalar, *tree, "pytree_to_scalar", tangent=tangent_p),
        ]
    return scenarios

"""The operator matrix: every operator x annotation kind x backend, unprepared and prepared.

Every expected value is analytic: hand-derived formulas evaluated with numpy
in float64 at the exact values that were passed (for JAX, the float32
inputs read back as float64). Nothing is compared against the library itself.

Annotation kinds (one "case" each):

- ``active``:   Active(x) alone
- ``constant``: Active(x), Constant(c)
- ``cache``:    Active(x), Cache(buf); f writes into buf and reads it back
- ``several``:  Active(x), Active(y)
- ``pytree``:   Active({"w", "b", "n": int, "name": str, "extra": None}), Constant(x)

Each case has a scalar function (gradient, hessian, hvp, jacobian of a
scalar) and a vector function whose Jacobian goes through the reverse branch
(outputs <= inputs: ``constant``, ``pytree``) or the forward branch
(outputs > inputs: ``active``, ``cache``, ``several``). Scalar-input operators
(derivative, second_derivative) have their own five cases.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import activity as ad
from activity import Active, Cache, Constant

# ============================================================================ helpers


def xp_of(*values: Any):
    """jax.numpy if any value is a JAX array (or tracer), else numpy."""
    return jnp if any(isinstance(v, jax.Array) for v in values) else np


def write(buf: Any, value: Any) -> Any:
    """Overwrite all of ``buf`` with ``value``: in place for numpy, ``.at[].set`` for JAX."""
    if isinstance(buf, np.ndarray):
        buf[...] = value
        return buf
    return buf.at[...].set(value)


def convert(tree: Any, to: Callable[[np.ndarray], Any]) -> Any:
    """Apply ``to`` to every floating numpy leaf of ``tree`` (dicts, lists, tuples)."""
    if isinstance(tree, dict):
        return {k: convert(v, to) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(convert(v, to) for v in tree)
    if isinstance(tree, np.ndarray) and tree.dtype.kind == "f":
        return to(tree)
    return tree


def to_jax32(x: np.ndarray) -> jax.Array:
    return jnp.asarray(x, dtype=jnp.float32)


def as64(tree: Any) -> Any:
    """Read back JAX arrays as float64 numpy arrays (the exact values that were passed)."""
    if isinstance(tree, dict):
        return {k: as64(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(as64(v) for v in tree)
    if isinstance(tree, (jax.Array, np.ndarray)) and np.asarray(tree).dtype.kind == "f":
        return np.asarray(tree, dtype=np.float64)
    return tree


def sech2(z: np.ndarray) -> np.ndarray:
    return 1.0 - np.tanh(z) ** 2


class Config:
    def __init__(self, name, backend, to, framework, dtype, rtol1, atol1, rtol2, atol2):
        self.name, self.backend, self.to = name, backend, to
        self.framework, self.dtype = framework, dtype
        self.tol = {1: dict(rtol=rtol1, atol=atol1), 2: dict(rtol=rtol2, atol=atol2)}

    def convert(self, tree: Any) -> Any:
        return convert(tree, self.to)


# JAX computes in float32 (its default): ~1e-5 relative. Finite differences on float64
# numpy inputs: ~1e-8 relative on smooth functions (its contract), first and second order
# (the absolute tolerance covers entries that are exactly zero).
CONFIGS = {
    "AutoJAX": Config("AutoJAX", ad.AutoJAX(), to_jax32, "jax", np.float32, 1e-5, 1e-5, 1e-5, 1e-5),
    "AutoFiniteDifferences": Config(
        "AutoFiniteDifferences", ad.AutoFiniteDifferences(), lambda x: x, "numpy", np.float64, 1e-8, 1e-8, 1e-8, 1e-8
    ),
}
BACKEND_IDS = list(CONFIGS)


# ============================================================================ array-input cases


class ActiveCase:
    """Active(x), x in R^3. Vector output in R^4 (Jacobian: forward branch)."""

    name = "active"
    A = np.array([[0.5, -0.3, 0.2], [0.1, 0.4, -0.6], [-0.7, 0.2, 0.3], [0.3, 0.3, 0.3]])

    def values(self, rng):
        return {"x": rng.uniform(-1, 1, 3)}

    def args(self, v):
        return [Active(v["x"])]

    # -- functions
    def scalar_f(self, x):
        xp = xp_of(x)
        return xp.sum(xp.sin(x)) + xp.sum(x * x) ** 2 / 4

    def vector_f(self, x):
        xp = xp_of(x)
        return xp.tanh(xp.asarray(self.A, dtype=x.dtype) @ x)

    # -- seeds
    def tangent(self, rng):
        return rng.normal(size=3)

    def cotangent(self, rng):
        return rng.normal(size=4)

    # -- analytic results
    def value_s(self, v):
        x = v["x"]
        return np.sum(np.sin(x)) + (x @ x) ** 2 / 4

    def grad_s(self, v):
        x = v["x"]
        return np.cos(x) + (x @ x) * x

    def hess_s(self, v):
        x = v["x"]
        return -np.diag(np.sin(x)) + (x @ x) * np.eye(3) + 2 * np.outer(x, x)

    def hvp_s(self, v, t):
        return self.hess_s(v) @ t

    def value_v(self, v):
        return np.tanh(self.A @ v["x"])

    def jac_v(self, v):
        return sech2(self.A @ v["x"])[:, None] * self.A

    def jvp_v(self, v, t):
        return self.jac_v(v) @ t

    def vjp_v(self, v, ct):
        return self.jac_v(v).T @ ct


class ConstantCase:
    """Active(x), Constant(c). Vector output in R^3 (Jacobian: reverse branch)."""

    name = "constant"

    def values(self, rng):
        return {"x": rng.uniform(-1, 1, 3), "c": rng.uniform(0.5, 1.5, 3)}

    def args(self, v):
        return [Active(v["x"]), Constant(v["c"])]

    def scalar_f(self, x, c):
        xp = xp_of(x, c)
        return xp.sum(xp.sin(c * x)) + xp.sum(x * c) ** 2 / 2

    def vector_f(self, x, c):
        xp = xp_of(x, c)
        return c * xp.tanh(x) + x[0] * x

    def tangent(self, rng):
        return rng.normal(size=3)

    def cotangent(self, rng):
        return rng.normal(size=3)

    def value_s(self, v):
        x, c = v["x"], v["c"]
        return np.sum(np.sin(c * x)) + (x @ c) ** 2 / 2

    def grad_s(self, v):
        x, c = v["x"], v["c"]
        return c * np.cos(c * x) + (x @ c) * c

    def hess_s(self, v):
        x, c = v["x"], v["c"]
        return -np.diag(c**2 * np.sin(c * x)) + np.outer(c, c)

    def hvp_s(self, v, t):
        return self.hess_s(v) @ t

    def value_v(self, v):
        x, c = v["x"], v["c"]
        return c * np.tanh(x) + x[0] * x

    def jac_v(self, v):
        x, c = v["x"], v["c"]
        jac = np.diag(c * sech2(x) + x[0])
        jac[:, 0] += x
        return jac

    def jvp_v(self, v, t):
        return self.jac_v(v) @ t

    def vjp_v(self, v, ct):
        return self.jac_v(v).T @ ct


class CacheCase:
    """Active(x), Cache(buf): f writes x**2 into buf and reads it back. Vector output in R^4 (forward)."""

    name = "cache"

    def values(self, rng):
        # The initial content of a Cache does not matter: fill it with garbage.
        return {"x": rng.uniform(-1, 1, 3), "buf": rng.normal(size=3) * 1e3}

    def args(self, v):
        return [Active(v["x"]), Cache(v["buf"])]

    def scalar_f(self, x, buf):
        xp = xp_of(x, buf)
        buf = write(buf, x**2)
        return xp.sum(buf * xp.sin(x)) + buf[0] * buf[1]

    def vector_f(self, x, buf):
        xp = xp_of(x, buf)
        buf = write(buf, x**2)
        return xp.concatenate([buf * xp.tanh(x), xp.reshape(buf[0] * buf[2], (1,))])

    def tangent(self, rng):
        return rng.normal(size=3)

    def cotangent(self, rng):
        return rng.normal(size=4)

    def value_s(self, v):
        x = v["x"]
        return np.sum(x**2 * np.sin(x)) + x[0] ** 2 * x[1] ** 2

    def grad_s(self, v):
        x = v["x"]
        g = 2 * x * np.sin(x) + x**2 * np.cos(x)
        g[0] += 2 * x[0] * x[1] ** 2
        g[1] += 2 * x[0] ** 2 * x[1]
        return g

    def hess_s(self, v):
        x = v["x"]
        h = np.diag(2 * np.sin(x) + 4 * x * np.cos(x) - x**2 * np.sin(x))
        h[0, 0] += 2 * x[1] ** 2
        h[1, 1] += 2 * x[0] ** 2
        h[0, 1] += 4 * x[0] * x[1]
        h[1, 0] += 4 * x[0] * x[1]
        return h

    def hvp_s(self, v, t):
        return self.hess_s(v) @ t

    def value_v(self, v):
        x = v["x"]
        return np.concatenate([x**2 * np.tanh(x), [x[0] ** 2 * x[2] ** 2]])

    def jac_v(self, v):
        x = v["x"]
        jac = np.zeros((4, 3))
        jac[:3] = np.diag(2 * x * np.tanh(x) + x**2 * sech2(x))
        jac[3] = [2 * x[0] * x[2] ** 2, 0.0, 2 * x[0] ** 2 * x[2]]
        return jac

    def jvp_v(self, v, t):
        return self.jac_v(v) @ t

    def vjp_v(self, v, ct):
        return self.jac_v(v).T @ ct


class SeveralCase:
    """Active(x), Active(y): results are tuples. Vector output of shape (2, 3) (forward)."""

    name = "several"

    def values(self, rng):
        return {"x": rng.uniform(-1, 1, 2), "y": rng.uniform(-1, 1, 3)}

    def args(self, v):
        return [Active(v["x"]), Active(v["y"])]

    def scalar_f(self, x, y):
        xp = xp_of(x, y)
        return xp.sum(xp.sin(x)) * xp.sum(y * y)

    def vector_f(self, x, y):
        xp = xp_of(x, y)
        return xp.sin(x)[:, None] * y[None, :]

    def tangent(self, rng):
        return (rng.normal(size=2), rng.normal(size=3))

    def cotangent(self, rng):
        return rng.normal(size=(2, 3))

    def value_s(self, v):
        x, y = v["x"], v["y"]
        return np.sum(np.sin(x)) * (y @ y)

    def grad_s(self, v):
        x, y = v["x"], v["y"]
        return (np.cos(x) * (y @ y), 2 * y * np.sum(np.sin(x)))

    def hess_s(self, v):
        x, y = v["x"], v["y"]
        hxy = np.outer(np.cos(x), 2 * y)
        return (
            (-np.diag(np.sin(x)) * (y @ y), hxy),
            (hxy.T, 2 * np.sum(np.sin(x)) * np.eye(3)),
        )

    def hvp_s(self, v, t):
        (hxx, hxy), (hyx, hyy) = self.hess_s(v)
        tx, ty = t
        return (hxx @ tx + hxy @ ty, hyx @ tx + hyy @ ty)

    def value_v(self, v):
        return np.outer(np.sin(v["x"]), v["y"])

    def jac_v(self, v):
        x, y = v["x"], v["y"]
        jx = np.zeros((2, 3, 2))
        jy = np.zeros((2, 3, 3))
        for i in range(2):
            jx[i, :, i] = np.cos(x[i]) * y
            for j in range(3):
                jy[i, j, j] = np.sin(x[i])
        return (jx, jy)

    def jvp_v(self, v, t):
        x, y = v["x"], v["y"]
        tx, ty = t
        return np.outer(np.cos(x) * tx, y) + np.outer(np.sin(x), ty)

    def vjp_v(self, v, ct):
        x, y = v["x"], v["y"]
        return (np.cos(x) * (ct @ y), ct.T @ np.sin(x))


class PytreeCase:
    """Active(dict with float, int, str and None leaves), Constant(x). Vector output in R^2 (reverse)."""

    name = "pytree"
    STATIC = {"n": None, "name": None, "extra": None}  # non-floating leaves: None in every result

    def values(self, rng):
        params = {
            "w": rng.uniform(-1, 1, (2, 2)),
            "b": rng.uniform(-1, 1, 2),
            "n": 3,
            "name": "layer",
            "extra": None,
        }
        return {"p": params, "x": rng.uniform(-1, 1, 2)}

    def args(self, v):
        return [Active(v["p"]), Constant(v["x"])]

    def scalar_f(self, p, x):
        assert p["name"] == "layer" and p["n"] == 3 and p["extra"] is None
        xp = xp_of(p["w"], x)
        z = p["w"] @ x + p["b"]
        return 0.5 * xp.sum(z * z) + p["n"] * xp.sum(xp.sin(p["b"]))

    def vector_f(self, p, x):
        assert p["name"] == "layer" and p["n"] == 3 and p["extra"] is None
        xp = xp_of(p["w"], x)
        return p["n"] * xp.tanh(p["w"] @ x + p["b"])

    def tangent(self, rng):
        # A tangent has the layout of the gradient: None at the non-floating leaves.
        return {"w": rng.normal(size=(2, 2)), "b": rng.normal(size=2), **self.STATIC}

    def cotangent(self, rng):
        return rng.normal(size=2)

    def _z(self, v):
        return v["p"]["w"] @ v["x"] + v["p"]["b"]

    def value_s(self, v):
        z, b, n = self._z(v), v["p"]["b"], v["p"]["n"]
        return 0.5 * z @ z + n * np.sum(np.sin(b))

    def grad_s(self, v):
        z, b, n, x = self._z(v), v["p"]["b"], v["p"]["n"], v["x"]
        return {"w": np.outer(z, x), "b": z + n * np.cos(b), **self.STATIC}

    def hess_s(self, v):
        b, n, x = v["p"]["b"], v["p"]["n"], v["x"]
        eye = np.eye(2)
        hww = np.einsum("ik,j,l->ijkl", eye, x, x)  # d2 / dw_ij dw_kl
        hwb = np.einsum("ik,j->ijk", eye, x)  # d2 / dw_ij db_k
        hbw = np.einsum("ki,j->kij", eye, x)  # d2 / db_k dw_ij
        hbb = eye - n * np.diag(np.sin(b))
        return {
            "w": {"w": hww, "b": hwb, **self.STATIC},
            "b": {"w": hbw, "b": hbb, **self.STATIC},
            **self.STATIC,
        }

    def hvp_s(self, v, t):
        b, n, x = v["p"]["b"], v["p"]["n"], v["x"]
        dz = t["w"] @ x + t["b"]
        return {"w": np.outer(dz, x), "b": dz - n * np.sin(b) * t["b"], **self.STATIC}

    def value_v(self, v):
        return v["p"]["n"] * np.tanh(self._z(v))

    def jac_v(self, v):
        s = v["p"]["n"] * sech2(self._z(v))
        return {"w": np.einsum("ik,l->ikl", np.diag(s), v["x"]), "b": np.diag(s), **self.STATIC}

    def jvp_v(self, v, t):
        s = v["p"]["n"] * sech2(self._z(v))
        return s * (t["w"] @ v["x"] + t["b"])

    def vjp_v(self, v, ct):
        s = v["p"]["n"] * sech2(self._z(v))
        return {"w": np.outer(s * ct, v["x"]), "b": s * ct, **self.STATIC}


CASES = [ActiveCase(), ConstantCase(), CacheCase(), SeveralCase(), PytreeCase()]

# ============================================================================ scalar-input cases


def _s(value: float) -> np.ndarray:
    return np.asarray(value, dtype=np.float64)


class DActiveCase:
    name = "active"

    def values(self, rng):
        return {"t": _s(rng.uniform(0.3, 1.2))}

    def args(self, v):
        return [Active(v["t"])]

    def f(self, t):
        xp = xp_of(t)
        return xp.stack([xp.sin(t), t**3])

    def value(self, v):
        t = v["t"]
        return np.array([np.sin(t), t**3])

    def d(self, v):
        t = v["t"]
        return np.array([np.cos(t), 3 * t**2])

    def d2(self, v):
        t = v["t"]
        return np.array([-np.sin(t), 6 * t])


class DConstantCase:
    name = "constant"

    def values(self, rng):
        return {"t": _s(rng.uniform(0.3, 1.2)), "c": rng.uniform(-1, 1, 3)}

    def args(self, v):
        return [Active(v["t"]), Constant(v["c"])]

    def f(self, t, c):
        return xp_of(t, c).exp(c * t)

    def value(self, v):
        return np.exp(v["c"] * v["t"])

    def d(self, v):
        return v["c"] * np.exp(v["c"] * v["t"])

    def d2(self, v):
        return v["c"] ** 2 * np.exp(v["c"] * v["t"])


class DCacheCase:
    name = "cache"

    def values(self, rng):
        return {"t": _s(rng.uniform(0.3, 1.2)), "buf": rng.normal(size=3) * 1e3}

    def args(self, v):
        return [Active(v["t"]), Cache(v["buf"])]

    def f(self, t, buf):
        xp = xp_of(t, buf)
        buf = write(buf, xp.stack([t, t**2, t**3]))
        return buf * buf

    def value(self, v):
        t = v["t"]
        return np.array([t**2, t**4, t**6])

    def d(self, v):
        t = v["t"]
        return np.array([2 * t, 4 * t**3, 6 * t**5])

    def d2(self, v):
        t = v["t"]
        return np.array([2.0, 12 * t**2, 30 * t**4])


class DSeveralCase:
    """Two scalar Actives and a dict output: tuples of dicts."""

    name = "several"

    def values(self, rng):
        return {"a": _s(rng.uniform(0.3, 1.2)), "b": _s(rng.uniform(0.3, 1.2))}

    def args(self, v):
        return [Active(v["a"]), Active(v["b"])]

    def f(self, a, b):
        return {"p": a * b * b, "q": xp_of(a, b).sin(a)}

    def value(self, v):
        a, b = v["a"], v["b"]
        return {"p": _s(a * b * b), "q": _s(np.sin(a))}

    def d(self, v):
        a, b = v["a"], v["b"]
        return ({"p": _s(b * b), "q": _s(np.cos(a))}, {"p": _s(2 * a * b), "q": _s(0.0)})

    def d2(self, v):
        a, b = v["a"], v["b"]
        zero = _s(0.0)
        return (
            ({"p": zero, "q": _s(-np.sin(a))}, {"p": _s(2 * b), "q": zero}),
            ({"p": _s(2 * b), "q": zero}, {"p": _s(2 * a), "q": zero}),
        )


class DPytreeCase:
    """Active({"t": float, "k": int, "tag": str}): None at the non-floating leaves."""

    name = "pytree"

    def values(self, rng):
        return {"p": {"t": _s(rng.uniform(0.3, 1.2)), "k": 2, "tag": "s"}}

    def args(self, v):
        return [Active(v["p"])]

    def f(self, p):
        assert p["k"] == 2 and p["tag"] == "s"
        xp = xp_of(p["t"])
        return xp.stack([p["t"] ** p["k"], xp.cos(p["t"])])

    def value(self, v):
        t = v["p"]["t"]
        return np.array([t**2, np.cos(t)])

    def d(self, v):
        t = v["p"]["t"]
        return {"t": np.array([2 * t, -np.sin(t)]), "k": None, "tag": None}

    def d2(self, v):
        t = v["p"]["t"]
        return {"t": {"t": np.array([2.0, -np.cos(t)]), "k": None, "tag": None}, "k": None, "tag": None}


DCASES = [DActiveCase(), DConstantCase(), DCacheCase(), DSeveralCase(), DPytreeCase()]

# ============================================================================ operators


class Spec:
    """One operator call: which function of the case it differentiates, its seed, its expected result."""

    def __init__(self, id: str, op: Callable, fn: str, expected: Callable, seed: str | None = None, order: int = 1):
        self.id, self.op, self.fn, self.expected, self.seed, self.order = id, op, fn, expected, seed, order

    def function(self, case) -> Callable:
        return getattr(case, self.fn)

    def seed_kwargs(self, case, rng) -> dict:
        if self.seed is None:
            return {}
        make = case.tangent if self.seed.startswith("tangent") else case.cotangent
        if self.seed.endswith("s"):
            return {self.seed: [make(rng), make(rng)]}
        return {self.seed: make(rng)}


def _per_seed(one: Callable) -> Callable:
    """Expected result for tangent=t (one result) or tangents=[...] (a list)."""

    def expected(case, v, seeds):
        ((key, seed),) = seeds.items()
        return [one(case, v, s) for s in seed] if key.endswith("s") else one(case, v, seed)

    return expected


def _with_head(head: Callable, one: Callable) -> Callable:
    return lambda case, v, seeds: (head(case, v), _per_seed(one)(case, v, seeds))


_hvp = lambda case, v, t: case.hvp_s(v, t)  # noqa: E731
_jvp = lambda case, v, t: case.jvp_v(v, t)  # noqa: E731
_vjp = lambda case, v, ct: case.vjp_v(v, ct)  # noqa: E731

SPECS = [
    Spec("gradient", ad.gradient, "scalar_f", lambda c, v, s: c.grad_s(v)),
    Spec("value_and_gradient", ad.value_and_gradient, "scalar_f", lambda c, v, s: (c.value_s(v), c.grad_s(v))),
    Spec("jacobian[scalar f]", ad.jacobian, "scalar_f", lambda c, v, s: c.grad_s(v)),
    Spec("jacobian", ad.jacobian, "vector_f", lambda c, v, s: c.jac_v(v)),
    Spec("value_and_jacobian", ad.value_and_jacobian, "vector_f", lambda c, v, s: (c.value_v(v), c.jac_v(v))),
    Spec("pushforward[tangent]", ad.pushforward, "vector_f", _per_seed(_jvp), "tangent"),
    Spec("pushforward[tangents]", ad.pushforward, "vector_f", _per_seed(_jvp), "tangents"),
    Spec("value_and_pushforward[tangent]", ad.value_and_pushforward, "vector_f",
         _with_head(lambda c, v: c.value_v(v), _jvp), "tangent"),
    Spec("value_and_pushforward[tangents]", ad.value_and_pushforward, "vector_f",
         _with_head(lambda c, v: c.value_v(v), _jvp), "tangents"),
    Spec("pullback[cotangent]", ad.pullback, "vector_f", _per_seed(_vjp), "cotangent"),
    Spec("pullback[cotangents]", ad.pullback, "vector_f", _per_seed(_vjp), "cotangents"),
    Spec("value_and_pullback[cotangent]", ad.value_and_pullback, "vector_f",
         _with_head(lambda c, v: c.value_v(v), _vjp), "cotangent"),
    Spec("value_and_pullback[cotangents]", ad.value_and_pullback, "vector_f",
         _with_head(lambda c, v: c.value_v(v), _vjp), "cotangents"),
    Spec("hessian", ad.hessian, "scalar_f", lambda c, v, s: c.hess_s(v), order=2),
    Spec("value_gradient_and_hessian", ad.value_gradient_and_hessian, "scalar_f",
         lambda c, v, s: (c.value_s(v), c.grad_s(v), c.hess_s(v)), order=2),
    Spec("hvp[tangent]", ad.hvp, "scalar_f", _per_seed(_hvp), "tangent", order=2),
    Spec("hvp[tangents]", ad.hvp, "scalar_f", _per_seed(_hvp), "tangents", order=2),
    Spec("gradient_and_hvp[tangent]", ad.gradient_and_hvp, "scalar_f",
         _with_head(lambda c, v: c.grad_s(v), _hvp), "tangent", order=2),
    Spec("gradient_and_hvp[tangents]", ad.gradient_and_hvp, "scalar_f",
         _with_head(lambda c, v: c.grad_s(v), _hvp), "tangents", order=2),
]

DSPECS = [
    Spec("derivative", ad.derivative, "f", lambda c, v, s: c.d(v)),
    Spec("value_and_derivative", ad.value_and_derivative, "f", lambda c, v, s: (c.value(v), c.d(v))),
    Spec("second_derivative", ad.second_derivative, "f", lambda c, v, s: c.d2(v), order=2),
    Spec("value_derivative_and_second_derivative", ad.value_derivative_and_second_derivative, "f",
         lambda c, v, s: (c.value(v), c.d(v), c.d2(v)), order=2),
]

MATRIX = [
    pytest.param(spec, case, id=f"{spec.id}-{case.name}") for spec in SPECS for case in CASES
] + [pytest.param(spec, case, id=f"{spec.id}-{case.name}") for spec in DSPECS for case in DCASES]


def _protected(args: list) -> list:
    """The values that must be left intact: every Active and Constant (a Cache may be overwritten)."""
    return [a.value for a in args if not isinstance(a, Cache)]


def _check(result, expected, cfg: Config, order: int, assert_tree_close) -> None:
    assert_tree_close(result, expected, **cfg.tol[order], framework=cfg.framework, dtype=cfg.dtype)


# ============================================================================ the matrix


@pytest.mark.parametrize("backend", BACKEND_IDS)
@pytest.mark.parametrize("spec, case", MATRIX)
def test_unprepared(spec, case, backend, assert_tree_close, intact):
    cfg = CONFIGS[backend]
    rng = np.random.default_rng(0)
    values = cfg.convert(case.values(rng))
    seeds = cfg.convert(spec.seed_kwargs(case, rng))
    args = case.args(values)

    with intact(_protected(args), seeds):
        result = spec.op(spec.function(case), *args, backend=cfg.backend, **seeds)

    _check(result, spec.expected(case, as64(values), as64(seeds)), cfg, spec.order, assert_tree_close)


@pytest.mark.parametrize("backend", BACKEND_IDS)
@pytest.mark.parametrize("spec, case", MATRIX)
def test_prepared(spec, case, backend, assert_tree_close, intact):
    """Prepared with one set of values, called with others (raw, then annotated): never stale."""
    cfg = CONFIGS[backend]
    rng = np.random.default_rng(1)
    prep_values = cfg.convert(case.values(rng))
    prep_seeds = cfg.convert(spec.seed_kwargs(case, rng))
    prepared = ad.prepare(spec.op, spec.function(case), *case.args(prep_values), backend=cfg.backend, **prep_seeds)

    for call in range(2):
        values = cfg.convert(case.values(rng))
        seeds = cfg.convert(spec.seed_kwargs(case, rng))
        args = case.args(values)
        # First call with raw values (they take the prepared kinds), then annotated.
        call_args = [a.value for a in args] if call == 0 else args
        with intact(_protected(args), seeds):
            result = prepared(*call_args, **seeds)

        expected = spec.expected(case, as64(values), as64(seeds))
        _check(result, expected, cfg, spec.order, assert_tree_close)
        # The check is meaningful: the answer at the preparation values is different.
        stale = spec.expected(case, as64(prep_values), as64(prep_seeds))
        with pytest.raises(AssertionError):
            assert_tree_close(stale, expected, rtol=1e-3, atol=1e-3)


# ============================================================================ has_aux


def _aux_f(x, c):
    xp = xp_of(x, c)
    return xp.sum(xp.sin(c * x)), {"sin": xp.sin(x), "label": "aux", "n": 7}


def _aux_vector_f(x, c):
    xp = xp_of(x, c)
    return c * xp.tanh(x), {"sin": xp.sin(x), "label": "aux", "n": 7}


def _aux_expected(name: str, x: np.ndarray, c: np.ndarray):
    aux = {"sin": np.sin(x), "label": "aux", "n": 7}
    if "gradient" in name:
        value, derivative = np.sum(np.sin(c * x)), c * np.cos(c * x)
    else:
        value, derivative = c * np.tanh(x), np.diag(c * sech2(x))
    if name.startswith("value_and"):
        return ((value, aux), derivative)
    return (derivative, aux)


AUX_OPS = [
    pytest.param(ad.gradient, _aux_f, id="gradient"),
    pytest.param(ad.value_and_gradient, _aux_f, id="value_and_gradient"),
    pytest.param(ad.jacobian, _aux_vector_f, id="jacobian"),
    pytest.param(ad.value_and_jacobian, _aux_vector_f, id="value_and_jacobian"),
]


@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
@pytest.mark.parametrize("backend", BACKEND_IDS)
@pytest.mark.parametrize("op, f", AUX_OPS)
def test_has_aux(op, f, backend, prepared, assert_tree_close, intact):
    cfg = CONFIGS[backend]
    rng = np.random.default_rng(2)
    x, c = cfg.convert(rng.uniform(-1, 1, 3)), cfg.convert(rng.uniform(0.5, 1.5, 3))
    with intact([x, c]):
        if prepared:
            prep_x, prep_c = cfg.convert(rng.uniform(-1, 1, 3)), cfg.convert(rng.uniform(0.5, 1.5, 3))
            result = ad.prepare(op, f, Active(prep_x), Constant(prep_c), backend=cfg.backend, has_aux=True)(x, c)
        else:
            result = op(f, Active(x), Constant(c), backend=cfg.backend, has_aux=True)
    expected = _aux_expected(op.__name__, as64(x), as64(c))
    # aux is returned untouched: its array is the framework's, its static leaves as f returned them.
    assert_tree_close(result, expected, **cfg.tol[1], framework=cfg.framework)


@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
@pytest.mark.parametrize("backend", BACKEND_IDS)
def test_has_aux_on_the_forward_jacobian_branch(backend, prepared, assert_tree_close):
    """More outputs than inputs: the forward branch, which must carry aux too."""
    cfg = CONFIGS[backend]
    rng = np.random.default_rng(11)
    x = cfg.convert(rng.uniform(-1, 1, 2))

    def f(x):
        xp = xp_of(x)
        return xp.concatenate([xp.sin(x), x**2]), {"sum": xp.sum(x), "tag": "a"}

    if prepared:
        result = ad.prepare(ad.value_and_jacobian, f, Active(cfg.convert(rng.uniform(-1, 1, 2))),
                            backend=cfg.backend, has_aux=True)(x)
    else:
        result = ad.value_and_jacobian(f, Active(x), backend=cfg.backend, has_aux=True)
    x64 = as64(x)
    expected = (
        (np.concatenate([np.sin(x64), x64**2]), {"sum": np.sum(x64), "tag": "a"}),
        np.concatenate([np.diag(np.cos(x64)), np.diag(2 * x64)]),
    )
    assert_tree_close(result, expected, **cfg.tol[1], framework=cfg.framework, dtype=cfg.dtype)


# ============================================================================ pytree outputs


def _dict_output(x, y):
    xp = xp_of(x, y)
    return {"a": xp.sin(x) * y[0], "b": xp.sum(x * x) * y}


def _dict_output_more(x, y):
    # One output more than inputs: the forward branch of jacobian.
    out = _dict_output(x, y)
    out["c"] = xp_of(x, y).sum(y) * x[0]
    return out


def _jac_dict_output(x, y, more: bool):
    ja_x = np.diag(np.cos(x) * y[0])
    ja_y = np.zeros((2, 3))
    ja_y[:, 0] = np.sin(x)
    jb_x = np.outer(y, 2 * x)
    jb_y = (x @ x) * np.eye(3)
    jac = {"a": (ja_x, ja_y), "b": (jb_x, jb_y)}
    if more:
        jac["c"] = (np.array([np.sum(y), 0.0]), np.full(3, x[0]))
    return jac


@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
@pytest.mark.parametrize("backend", BACKEND_IDS)
@pytest.mark.parametrize("more", [False, True], ids=["reverse-branch", "forward-branch"])
def test_jacobian_of_dict_output_with_several_actives(more, backend, prepared, assert_tree_close, intact):
    """jax.jacobian layout: output structure outer, a tuple over the Active arguments inner."""
    cfg = CONFIGS[backend]
    rng = np.random.default_rng(3)
    f = _dict_output_more if more else _dict_output
    x, y = cfg.convert(rng.uniform(-1, 1, 2)), cfg.convert(rng.uniform(-1, 1, 3))
    with intact([x, y]):
        if prepared:
            prep = ad.prepare(ad.jacobian, f, Active(x * 0.5), Active(y * 2.0), backend=cfg.backend)
            result = prep(x, y)
        else:
            result = ad.jacobian(f, Active(x), Active(y), backend=cfg.backend)
    expected = _jac_dict_output(as64(x), as64(y), more)
    assert_tree_close(result, expected, **cfg.tol[1], framework=cfg.framework, dtype=cfg.dtype)
    # The same layout as a raw jax.jacobian over both arguments.
    raw = jax.jacobian(f, argnums=(0, 1))(jnp.asarray(as64(x), jnp.float32), jnp.asarray(as64(y), jnp.float32))
    assert_tree_close(result, jax.tree_util.tree_map(np.asarray, raw), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKEND_IDS)
def test_pushforward_and_pullback_of_dict_output(backend, assert_tree_close, intact):
    cfg = CONFIGS[backend]
    rng = np.random.default_rng(4)
    x, y = cfg.convert(rng.uniform(-1, 1, 2)), cfg.convert(rng.uniform(-1, 1, 3))
    tx, ty = cfg.convert(rng.normal(size=2)), cfg.convert(rng.normal(size=3))
    ct = cfg.convert({"a": rng.normal(size=2), "b": rng.normal(size=3)})
    jac = _jac_dict_output(as64(x), as64(y), False)
    t64, ct64 = as64((tx, ty)), as64(ct)
    expected_jvp = {k: jac[k][0] @ t64[0] + jac[k][1] @ t64[1] for k in jac}
    expected_vjp = tuple(sum(ct64[k] @ jac[k][i] for k in jac) for i in range(2))
    with intact([x, y, tx, ty, ct]):
        jvp = ad.pushforward(_dict_output, Active(x), Active(y), backend=cfg.backend, tangent=(tx, ty))
        vjps = ad.pullback(_dict_output, Active(x), Active(y), backend=cfg.backend, cotangents=[ct, ct])
    assert_tree_close(jvp, expected_jvp, **cfg.tol[1], framework=cfg.framework, dtype=cfg.dtype)
    assert_tree_close(vjps, [expected_vjp, expected_vjp], **cfg.tol[1], framework=cfg.framework, dtype=cfg.dtype)


# ============================================================================ inputs of other kinds


@pytest.mark.parametrize("backend", BACKEND_IDS)
def test_python_float_actives(backend, assert_tree_close):
    """Python floats are scalar Actives on every backend; results are 0-d arrays of the backend."""
    cfg = CONFIGS[backend]
    dtype = np.float32 if backend == "AutoJAX" else np.float64
    f = lambda a, b: a * a * b + xp_of(a, b).sin(a)  # noqa: E731
    a, b = 0.7, 1.3
    expected_d = (np.asarray(2 * a * b + np.cos(a)), np.asarray(a * a))
    assert_tree_close(ad.derivative(f, Active(a), Active(b), backend=cfg.backend), expected_d,
                      **cfg.tol[1], framework=cfg.framework, dtype=dtype)
    assert_tree_close(ad.gradient(f, Active(a), Active(b), backend=cfg.backend), expected_d,
                      **cfg.tol[1], framework=cfg.framework, dtype=dtype)
    expected_d2 = ((np.asarray(2 * b - np.sin(a)), np.asarray(2 * a)), (np.asarray(2 * a), np.asarray(0.0)))
    assert_tree_close(ad.second_derivative(f, Active(a), Active(b), backend=cfg.backend), expected_d2,
                      **cfg.tol[2], framework=cfg.framework, dtype=dtype)


FD_ON_JAX = [
    pytest.param(ad.gradient, "scalar_f", lambda c, v, s: c.grad_s(v), None, id="gradient"),
    pytest.param(ad.value_and_gradient, "scalar_f", lambda c, v, s: (c.value_s(v), c.grad_s(v)), None,
                 id="value_and_gradient"),
    pytest.param(ad.jacobian, "vector_f", lambda c, v, s: c.jac_v(v), None, id="jacobian"),
    pytest.param(ad.pushforward, "vector_f", lambda c, v, s: c.jvp_v(v, s["tangent"]), "tangent", id="pushforward"),
    pytest.param(ad.pullback, "vector_f", lambda c, v, s: c.vjp_v(v, s["cotangent"]), "cotangent", id="pullback"),
    pytest.param(ad.hessian, "scalar_f", lambda c, v, s: c.hess_s(v), None, id="hessian"),
    pytest.param(ad.hvp, "scalar_f", lambda c, v, s: c.hvp_s(v, s["tangent"]), "tangent", id="hvp"),
]


FD_ON_JAX_MATRIX = [
    pytest.param(*p.values, case, id=f"{p.id}-{case.name}")
    for p in FD_ON_JAX
    for case in (ConstantCase(), CacheCase(), PytreeCase())
    # Eager float64 JAX is slow under finite differences: second order on one case only.
    if p.id not in ("hessian", "hvp") or case.name == "constant"
]


@pytest.mark.parametrize("op, fn, expected, seed, case", FD_ON_JAX_MATRIX)
def test_finite_differences_on_jax_float32_inputs(op, fn, expected, seed, case, assert_tree_close, intact):
    """AutoFiniteDifferences evaluates JAX inputs in float64 and returns JAX float32 arrays."""
    rng = np.random.default_rng(5)
    values = convert(case.values(rng), to_jax32)
    spec = Spec("", op, fn, expected, seed)
    seeds = convert(spec.seed_kwargs(case, rng), to_jax32)
    args = case.args(values)
    with intact(_protected(args), seeds):
        result = op(getattr(case, fn), *args, backend=ad.AutoFiniteDifferences(), **seeds)
    # Computed in float64, rounded to float32 at the end: float32 accuracy.
    assert_tree_close(result, expected(case, as64(values), as64(seeds)), rtol=2e-6, atol=2e-6,
                      framework="jax", dtype=np.float32)
    assert jax.config.jax_enable_x64 is False  # the float64 context did not leak


@pytest.mark.parametrize("backend", BACKEND_IDS)
def test_cache_with_nan_initial_content(backend, assert_tree_close):
    """A Cache's initial content does not matter, even NaN: f overwrites it before reading."""
    cfg = CONFIGS[backend]
    case = CacheCase()
    rng = np.random.default_rng(6)
    values = cfg.convert({"x": rng.uniform(-1, 1, 3), "buf": np.full(3, np.nan)})
    g = ad.gradient(case.scalar_f, *case.args(values), backend=cfg.backend)
    assert_tree_close(g, case.grad_s(as64(values)), **cfg.tol[1], framework=cfg.framework)
    h = ad.hessian(case.scalar_f, *case.args(values), backend=cfg.backend)
    assert_tree_close(h, case.hess_s(as64(values)), **cfg.tol[2], framework=cfg.framework)


@pytest.mark.parametrize("backend", BACKEND_IDS)
def test_cache_pytree(backend, assert_tree_close):
    """A Cache may be a pytree of buffers; each is handed to f as writable scratch space."""
    cfg = CONFIGS[backend]
    rng = np.random.default_rng(7)
    x = cfg.convert(rng.uniform(-1, 1, 3))
    bufs = cfg.convert({"sq": np.zeros(3), "cube": [np.zeros(3)]})

    def f(x, bufs):
        xp = xp_of(x)
        sq = write(bufs["sq"], x**2)
        cube = write(bufs["cube"][0], sq * x)
        return xp.sum(sq * cube)  # sum(x**5)

    g = ad.gradient(f, Active(x), Cache(bufs), backend=cfg.backend)
    assert_tree_close(g, 5 * as64(x) ** 4, **cfg.tol[1], framework=cfg.framework, dtype=cfg.dtype)


def test_constant_non_array_values(assert_tree_close):
    """Constants may be callables, strings and config objects; they reach f as they are."""
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.uniform(-1, 1, 3), jnp.float32)
    config = {"activation": jnp.tanh, "mode": "sum", "scale": 2.0, "data": jnp.arange(3.0)}

    def f(x, config, name):
        assert name == "model" and config["mode"] == "sum"
        return config["scale"] * jnp.sum(config["activation"](x * config["data"]))

    for prepared in (False, True):
        if prepared:
            g = ad.prepare(ad.gradient, f, Active(x), Constant(config), Constant("model"))(x, config, "model")
        else:
            g = ad.gradient(f, Active(x), Constant(config), Constant("model"))
        data = np.arange(3.0)
        assert_tree_close(g, 2.0 * data * sech2(as64(x) * data), rtol=1e-5, atol=1e-6, framework="jax")


@pytest.mark.parametrize(
    "backend, cache_dtype",
    [
        pytest.param("AutoJAX", jnp.float16, id="AutoJAX-float16"),
        pytest.param("AutoJAX", jnp.bfloat16, id="AutoJAX-bfloat16"),
        pytest.param("AutoFiniteDifferences", np.float16, id="AutoFiniteDifferences-float16"),
    ],
)
def test_cache_buffer_can_hold_the_differentiated_values(backend, cache_dtype, assert_tree_close):
    """The contract: f gets a buffer "whose dtype can hold the values being differentiated",
    whatever the floating dtype of the user's (scratch) buffer."""
    cfg = CONFIGS[backend]
    case = CacheCase()
    rng = np.random.default_rng(9)
    x = cfg.convert(rng.uniform(-1, 1, 3))
    xp = jnp if backend == "AutoJAX" else np
    buf = xp.zeros(3, dtype=cache_dtype)
    g = ad.gradient(case.scalar_f, Active(x), Cache(buf), backend=cfg.backend)
    assert_tree_close(g, case.grad_s({"x": as64(x)}), **cfg.tol[1], framework=cfg.framework, dtype=cfg.dtype)


def test_finite_differences_keep_each_inputs_dtype(assert_tree_close):
    """Values come back in the dtype of the inputs: one float32 and one float64 Active."""
    rng = np.random.default_rng(10)
    a, b = rng.uniform(-1, 1, 2).astype(np.float32), rng.uniform(-1, 1, 3)
    f = lambda a, b: np.sum(np.sin(a)) * np.sum(b * b)  # noqa: E731
    ga, gb = ad.gradient(f, Active(a), Active(b), backend=ad.AutoFiniteDifferences())
    a64 = a.astype(np.float64)
    assert_tree_close(gb, 2 * b * np.sum(np.sin(a64)), rtol=1e-8, atol=1e-8, dtype=np.float64)
    assert_tree_close(ga, np.cos(a64) * np.sum(b * b), rtol=1e-6, atol=1e-7, dtype=np.float32)


FD_ACCURACY = [
    pytest.param(lambda x: np.sum(np.exp(5 * x)), lambda x: 5 * np.exp(5 * x), 1.0, id="exp(5x)"),
    pytest.param(lambda x: np.sum(np.sin(20 * x)), lambda x: 20 * np.cos(20 * x), 1.0, id="sin(20x)"),
    pytest.param(lambda x: 1e-8 * np.sum(x**3), lambda x: 3e-8 * x**2, 1.0, id="tiny-scale"),
    pytest.param(lambda x: 1e8 * np.sum(np.tanh(x)), lambda x: 1e8 * sech2(x), 1.0, id="huge-scale"),
    pytest.param(lambda x: np.sum(np.sin(x)), lambda x: np.cos(x), 1000.0, id="large-inputs"),
    pytest.param(lambda x: np.sum(np.log(x)), lambda x: 1 / x, 0.05, id="log-near-its-domain-boundary"),
]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("f, grad, scale", FD_ACCURACY)
def test_finite_differences_are_accurate_to_1e8_on_smooth_functions(f, grad, scale, assert_tree_close):
    x = scale * np.array([0.9, 0.4, 1.3])
    g = ad.gradient(f, Active(x), backend=ad.AutoFiniteDifferences())
    assert_tree_close(g, grad(x), rtol=1e-8, atol=0, framework="numpy", dtype=np.float64)


def _untraceable(x):
    """No AD system can trace this: it leaves the framework, converts to Python floats and branches."""
    total = 0.0
    for xi in np.asarray(x, dtype=np.float64).tolist():
        total += math.sin(xi) if xi > 0 else xi * xi
    return np.asarray(total)


@pytest.mark.parametrize("to, framework, dtype", [
    pytest.param(lambda x: x, "numpy", np.float64, id="numpy-float64"),
    pytest.param(to_jax32, "jax", np.float32, id="jax-float32"),
])
def test_finite_differences_work_on_untraceable_functions(to, framework, dtype, assert_tree_close):
    x = to(np.array([0.5, -0.7, 1.2]))
    g = ad.gradient(_untraceable, Active(x), backend=ad.AutoFiniteDifferences())
    x64 = as64(x)
    expected = np.where(x64 > 0, np.cos(x64), 2 * x64)
    tol = 1e-8 if framework == "numpy" else 1e-6
    assert_tree_close(g, expected, rtol=tol, atol=tol, framework=framework, dtype=dtype)


@pytest.mark.parametrize("backend", ["AutoJAX", "AutoTorch", "AutoFiniteDifferences"])
def test_a_cache_leaf_that_is_not_floating_keeps_its_dtype(backend):
    """Counters, indices and masks in a Cache (an Equinox State, an index buffer) keep their
    dtype, so f can use them as it would its own; floating leaves are promoted."""
    import torch

    seen = []
    if backend == "AutoTorch":
        x, cache = torch.arange(1.0, 4.0), (torch.tensor(2), torch.tensor([True, False, True]), torch.zeros(3))
    else:
        xp = jnp if backend == "AutoJAX" else np
        x, cache = xp.arange(1.0, 4.0), (xp.asarray(2), xp.asarray([True, False, True]), xp.zeros(3))

    def f(x, c):
        index, mask, buffer = c
        seen.append((str(index.dtype), str(mask.dtype)))
        return (x[index] * 3 + (x * mask).sum()) + 0 * buffer.sum()

    backend_object = {"AutoJAX": ad.AutoJAX(), "AutoTorch": ad.AutoTorch(), "AutoFiniteDifferences": ad.AutoFiniteDifferences()}[backend]
    g = ad.gradient(f, Active(x), Cache(cache), backend=backend_object)
    np.testing.assert_allclose(np.asarray(g), [1.0, 0.0, 4.0])  # d/dx of 3 x[2] + x[0] + x[2]
    assert all("int" in index and "bool" in mask for index, mask in seen), seen

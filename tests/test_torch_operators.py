"""AutoTorch: every operator x annotation case, prepared and unprepared, against raw torch.func."""

from __future__ import annotations

import pytest
import torch
from torch.func import grad, hessian, jacrev, jvp, vjp

import activity as ad
from activity import Active, Cache, Constant

torch_gen = lambda seed: torch.Generator().manual_seed(seed)  # noqa: E731


def randn(*shape, seed, dtype=torch.float64):
    return torch.randn(*shape, generator=torch_gen(seed), dtype=dtype)


W = randn(3, seed=0)
V = randn(2, seed=1)
C = randn(3, seed=2)


def scalar_math(w, v, c):
    return torch.sum(torch.tanh(w * c) ** 2) + torch.sin(v).sum() * w[0] + (v**3).sum()


def vector_math(w, v, c):
    return torch.cat([torch.sin(w * c), v * w[1], (w[:2] * v) ** 2])


def _with_cache(math):
    def f(w, v, c, buf):
        buf[:3] = w * c  # in place, read back below
        buf[3:].copy_(v)
        buf.mul_(1.0)
        return math(buf[:3] / c, buf[3:], c)

    return f


# name -> (f for activity, annotated args from (w, v, c), pure function of the Active tensors, pack result)
CASES = {
    "active": (
        lambda math: (lambda w: math(w, V, C)),
        lambda w, v, c: (Active(w),),
        lambda math: (lambda w: math(w, V, C)),
        lambda r: (r,),
    ),
    "constant": (
        lambda math: (lambda w, c: math(w, V, c)),
        lambda w, v, c: (Active(w), Constant(c)),
        lambda math: (lambda w: math(w, V, C)),
        lambda r: (r,),
    ),
    "cache": (
        lambda math: (lambda w, buf: _with_cache(math)(w, V, C, buf)),
        lambda w, v, c: (Active(w), Cache(torch.zeros(5, dtype=torch.float64))),
        lambda math: (lambda w: math(w, V, C)),
        lambda r: (r,),
    ),
    "several": (
        lambda math: (lambda w, v, c: math(w, v, c)),
        lambda w, v, c: (Active(w), Active(v), Constant(c)),
        lambda math: (lambda w, v: math(w, v, C)),
        lambda r: tuple(r),
    ),
    "pytree": (
        lambda math: (lambda p, c: math(p["w"], p["rest"][0], c)),
        lambda w, v, c: (Active({"w": w, "rest": [v, 3], "name": "x"}), Constant(c)),
        lambda math: (lambda w, v: math(w, v, C)),
        lambda r: (r["w"], r["rest"][0]),
    ),
}


def _setup(case, math, w=W, v=V):
    make_f, make_args, make_pure, pack = CASES[case]
    f = make_f(math)
    args = make_args(w, v, C)
    pure = make_pure(math)
    actives = (w,) if case in ("active", "constant", "cache") else (w, v)
    return f, args, pure, pack, actives


def _tangent_like(case, seed):
    tw, tv = randn(3, seed=seed), randn(2, seed=seed + 1)
    if case in ("active", "constant", "cache"):
        return tw, (tw,)
    if case == "several":
        return (tw, tv), (tw, tv)
    return {"w": tw, "rest": [tv, None], "name": None}, (tw, tv)


def _close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12)


def _run(op, f, args, prepared, **kwargs):
    """Unprepared, or prepared with other values (stale-data check) then called on ``args``."""
    if not prepared:
        return op(f, *args, **kwargs)
    stale = tuple(type(a)(_perturb(a.value)) for a in args)
    prep = ad.prepare(op, f, *stale, **{k: v for k, v in kwargs.items()})
    return prep(*args, **kwargs)


def _perturb(value):
    if isinstance(value, torch.Tensor):
        return value + 0.37
    if isinstance(value, dict):
        return {k: _perturb(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_perturb(v) for v in value]
    return value


CASE_NAMES = list(CASES)
PREPARED = [pytest.param(False, id="unprepared"), pytest.param(True, id="prepared")]


@pytest.mark.parametrize("prepared", PREPARED)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_gradient(case, prepared):
    f, args, pure, pack, actives = _setup(case, scalar_math)
    expected = grad(pure, argnums=tuple(range(len(actives))))(*actives)
    value, result = _run(ad.value_and_gradient, f, args, prepared)
    for a, e in zip(pack(result), expected):
        _close(a, e)
    _close(value, pure(*actives))
    for a, e in zip(pack(_run(ad.gradient, f, args, prepared)), expected):
        _close(a, e)


@pytest.mark.parametrize("prepared", PREPARED)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_jacobian(case, prepared):
    f, args, pure, pack, actives = _setup(case, vector_math)
    expected = jacrev(pure, argnums=tuple(range(len(actives))))(*actives)
    value, result = _run(ad.value_and_jacobian, f, args, prepared)
    for a, e in zip(pack(result), expected):
        _close(a, e)
    _close(value, pure(*actives))


@pytest.mark.parametrize("prepared", PREPARED)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_pushforward(case, prepared):
    f, args, pure, pack, actives = _setup(case, vector_math)
    tangent, raw_tangent = _tangent_like(case, 10)
    tangent2, raw_tangent2 = _tangent_like(case, 20)
    value, expected = jvp(pure, actives, raw_tangent)
    got_value, got = _run(ad.value_and_pushforward, f, args, prepared, tangent=tangent)
    _close(got, expected)
    _close(got_value, value)
    batch = _run(ad.pushforward, f, args, prepared, tangents=[tangent, tangent2])
    _close(batch[0], expected)
    _close(batch[1], jvp(pure, actives, raw_tangent2)[1])


@pytest.mark.parametrize("prepared", PREPARED)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_pullback(case, prepared):
    f, args, pure, pack, actives = _setup(case, vector_math)
    value, pull = vjp(pure, *actives)
    cts = [randn(value.shape[0], seed=s) for s in (30, 31)]
    got_value, got = _run(ad.value_and_pullback, f, args, prepared, cotangent=cts[0])
    _close(got_value, value)
    for a, e in zip(pack(got), pull(cts[0])):
        _close(a, e)
    batch = _run(ad.pullback, f, args, prepared, cotangents=cts)
    for b, ct in enumerate(cts):
        for a, e in zip(pack(batch[b]), pull(ct)):
            _close(a, e)


@pytest.mark.parametrize("prepared", PREPARED)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_hessian(case, prepared):
    f, args, pure, pack, actives = _setup(case, scalar_math)
    n = len(actives)
    expected = hessian(pure, argnums=tuple(range(n)))(*actives)
    value, gradient, result = _run(ad.value_gradient_and_hessian, f, args, prepared)
    rows = pack(result)
    for i in range(n):
        columns = pack(rows[i])
        for j in range(n):
            _close(columns[j], expected[i][j])
    _close(value, pure(*actives))
    for a, e in zip(pack(gradient), grad(pure, argnums=tuple(range(n)))(*actives)):
        _close(a, e)


@pytest.mark.parametrize("prepared", PREPARED)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_hvp(case, prepared):
    f, args, pure, pack, actives = _setup(case, scalar_math)
    n = len(actives)
    tangent, raw_tangent = _tangent_like(case, 40)
    tangent2, raw_tangent2 = _tangent_like(case, 50)
    gradient_fn = grad(pure, argnums=tuple(range(n)))
    expected = jvp(gradient_fn, actives, raw_tangent)[1]
    got_grad, got = _run(ad.gradient_and_hvp, f, args, prepared, tangent=tangent)
    for a, e in zip(pack(got), expected):
        _close(a, e)
    for a, e in zip(pack(got_grad), gradient_fn(*actives)):
        _close(a, e)
    batch = _run(ad.hvp, f, args, prepared, tangents=[tangent, tangent2])
    for a, e in zip(pack(batch[1]), jvp(gradient_fn, actives, raw_tangent2)[1]):
        _close(a, e)


@pytest.mark.parametrize("prepared", PREPARED)
@pytest.mark.parametrize("with_cache", [False, True], ids=["plain", "cache"])
def test_derivatives_of_scalars(with_cache, prepared):
    s, t = torch.tensor(0.7, dtype=torch.float64), torch.tensor(-0.4, dtype=torch.float64)

    def math(s, t):
        return torch.stack([torch.sin(s) * t**2, torch.exp(s * t)])

    if with_cache:

        def f(s, t, buf):
            buf[0] = s
            buf[1] = t
            return math(buf[0], buf[1])

        args = (Active(s), Active(t), Cache(torch.zeros(2, dtype=torch.float64)))
    else:
        f, args = math, (Active(s), Active(t))
    d_s = jvp(math, (s, t), (torch.ones(()), torch.zeros(()).double()))[1]
    d_t = jvp(math, (s, t), (torch.zeros(()).double(), torch.ones(()).double()))[1]
    value, (ds, dt) = _run(ad.value_and_derivative, f, args, prepared)
    _close(value, math(s, t))
    _close(ds, d_s.double())
    _close(dt, d_t)
    second = _run(ad.second_derivative, f, args, prepared)
    analytic = {
        (0, 0): torch.stack([-torch.sin(s) * t**2, t * t * torch.exp(s * t)]),
        (0, 1): torch.stack([2 * t * torch.cos(s), (1 + s * t) * torch.exp(s * t)]),
        (1, 1): torch.stack([2 * torch.sin(s), s * s * torch.exp(s * t)]),
    }
    for (i, j), e in analytic.items():
        _close(second[i][j], e)
        _close(second[j][i], e)


def test_float32_results_keep_dtype_and_device():
    w = randn(3, seed=3, dtype=torch.float32)
    g = ad.gradient(lambda w: (w**2).sum(), Active(w))
    assert g.dtype == torch.float32 and g.device == w.device
    h = ad.hessian(lambda w: (w**3).sum(), Active(w))
    assert h.dtype == torch.float32
    fd = ad.gradient(lambda w: (w**2).sum(), Active(w), backend=ad.AutoFiniteDifferences())
    assert fd.dtype == torch.float32
    torch.testing.assert_close(fd, 2 * w)


def test_complex_input_is_unsupported():
    z = torch.ones(2, dtype=torch.complex64)
    with pytest.raises(ad.UnsupportedError, match="complex"):
        ad.gradient(lambda z: z.abs().sum(), Active(z))


def test_inference_picks_torch():
    w = randn(2, seed=4)
    torch.testing.assert_close(ad.gradient(lambda w: (w**2).sum(), Active(w)), 2 * w)

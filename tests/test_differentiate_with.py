"""`differentiate_with`: a function of one framework inside another framework's transforms.

Every derivative is compared with an independent answer: the same MLP written in the
caller's framework with copied weights (differentiated by that framework alone),
``scipy.special.erf`` against its analytic derivatives, and an ODE solved by SciPy
against the derivative of its closed-form solution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.integrate
import scipy.special
import torch

import activity as ad
from activity import Active, Cache, Constant, UnsupportedError
from activity.testing import assert_tree_allclose

TORCH = ad.AutoTorch()
FD = ad.AutoFiniteDifferences()
RTOL, ATOL = 2e-5, 2e-6


def torch_mlp(width: int = 4, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.Tanh(), torch.nn.Linear(width, 2))


def jax_params(model: torch.nn.Module) -> dict[str, jax.Array]:
    return {name: jnp.asarray(p.detach().numpy()) for name, p in model.named_parameters()}


def jax_mlp(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    hidden = jnp.tanh(x @ params["0.weight"].T + params["0.bias"])
    return hidden @ params["2.weight"].T + params["2.bias"]


def torch_mlp_of(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    hidden = torch.tanh(x @ params["0.weight"].T + params["0.bias"])
    return hidden @ params["2.weight"].T + params["2.bias"]


def erf_prime(x: np.ndarray) -> np.ndarray:
    return 2 / np.sqrt(np.pi) * np.exp(-(x**2))


def erf_second(x: np.ndarray) -> np.ndarray:
    return -2 * x * erf_prime(x)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return torch_mlp()


@pytest.fixture(scope="module")
def xs() -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).standard_normal((5, 3)), dtype=jnp.float32)


# ------------------------------------------------------------------ torch inside JAX


def test_torch_model_in_jax_grad_jit_and_value_and_grad(model, xs):
    h = ad.differentiate_with(model, TORCH)
    params = jax_params(model)
    loss = lambda x: jnp.sum(jnp.sin(h(x)) ** 2)  # noqa: E731
    reference = lambda x: jnp.sum(jnp.sin(jax_mlp(params, x)) ** 2)  # noqa: E731
    assert_tree_allclose(h(xs), jax_mlp(params, xs), rtol=RTOL, atol=ATOL)
    assert_tree_allclose(jax.grad(loss)(xs), jax.grad(reference)(xs), rtol=RTOL, atol=ATOL)
    jitted = jax.jit(jax.value_and_grad(loss))
    for x in (xs, 2 * xs + 1):  # new values, same signature: never results of the first call
        assert_tree_allclose(jitted(x), jax.value_and_grad(reference)(x), rtol=RTOL, atol=ATOL)


def test_torch_model_under_vmap_jvp_and_hessian(model, xs):
    h = ad.differentiate_with(model, TORCH)
    params = jax_params(model)
    loss = lambda x: jnp.sum(jnp.tanh(h(x)))  # noqa: E731
    reference = lambda x: jnp.sum(jnp.tanh(jax_mlp(params, x)))  # noqa: E731
    x, t = xs[0], xs[1]
    assert_tree_allclose(jax.vmap(jax.grad(loss))(xs), jax.vmap(jax.grad(reference))(xs), rtol=RTOL, atol=ATOL)
    assert_tree_allclose(jax.jit(jax.vmap(h))(xs), jax.vmap(lambda v: jax_mlp(params, v))(xs), rtol=RTOL, atol=ATOL)
    assert_tree_allclose(jax.jvp(loss, (x,), (t,)), jax.jvp(reference, (x,), (t,)), rtol=RTOL, atol=ATOL)
    assert_tree_allclose(jax.jacrev(h)(x), jax.jacrev(lambda v: jax_mlp(params, v))(x), rtol=RTOL, atol=ATOL)
    assert_tree_allclose(jax.jacfwd(h)(x), jax.jacfwd(lambda v: jax_mlp(params, v))(x), rtol=RTOL, atol=ATOL)
    assert_tree_allclose(jax.hessian(loss)(x), jax.hessian(reference)(x), rtol=1e-4, atol=1e-5)
    assert_tree_allclose(jax.jit(jax.hessian(loss))(x), jax.hessian(reference)(x), rtol=1e-4, atol=1e-5)
    # nested batches: points batched by vmap, seeds batched by jacrev / hessian inside it
    mlp = lambda v: jax_mlp(params, v)  # noqa: E731
    assert_tree_allclose(jax.vmap(jax.jacrev(h))(xs), jax.vmap(jax.jacrev(mlp))(xs), rtol=RTOL, atol=ATOL)
    assert_tree_allclose(jax.vmap(jax.hessian(loss))(xs[:2]), jax.vmap(jax.hessian(reference))(xs[:2]),
                         rtol=1e-4, atol=1e-5)


def test_forward_mode_under_jit_and_linearize(model, xs):
    """Forward mode with jit on either side (jit traces h before any tangent exists) and
    jax.linearize: the inner pushforward, against the same MLP in JAX."""
    h = ad.differentiate_with(model, TORCH)
    params = jax_params(model)
    mlp = lambda v: jax_mlp(params, v)  # noqa: E731
    x, t = xs[0], xs[1]
    expected = jax.jvp(mlp, (x,), (t,))
    assert_tree_allclose(jax.jvp(jax.jit(h), (x,), (t,)), expected, rtol=RTOL, atol=ATOL)
    assert_tree_allclose(jax.jit(lambda a, b: jax.jvp(h, (a,), (b,)))(x, t), expected, rtol=RTOL, atol=ATOL)
    for v in (x, 3 * x - 1):  # new values through the compiled forward-mode program
        assert_tree_allclose(jax.jit(jax.jacfwd(h))(v), jax.jacfwd(mlp)(v), rtol=RTOL, atol=ATOL)
    assert_tree_allclose(jax.jacfwd(jax.jit(h))(x), jax.jacfwd(mlp)(x), rtol=RTOL, atol=ATOL)
    value, linear = jax.linearize(h, x)
    assert_tree_allclose((value, linear(t)), expected, rtol=RTOL, atol=ATOL)
    assert_tree_allclose(linear(2 * t), 2 * expected[1], rtol=RTOL, atol=ATOL)
    # batched tangents at one point, under jit: forward over the batch
    ts = xs[1:4]
    assert_tree_allclose(jax.jit(jax.vmap(lambda u: jax.jvp(h, (x,), (u,))[1]))(ts),
                         jax.vmap(lambda u: jax.jvp(mlp, (x,), (u,))[1])(ts), rtol=RTOL, atol=ATOL)
    # reverse mode through the jitted h (transposing the same function's tangent)
    loss = lambda v: jnp.sum(jnp.sin(jax.jit(h)(v)) ** 2)  # noqa: E731
    assert_tree_allclose(jax.grad(loss)(x), jax.grad(lambda v: jnp.sum(jnp.sin(mlp(v)) ** 2))(x),
                         rtol=RTOL, atol=ATOL)


def test_each_mode_runs_only_its_own_inner_operator(model, xs, monkeypatch):
    """Reverse mode takes the inner pullback and forward mode the inner pushforward, each
    alone, with jit inside or outside (one function serves both modes)."""
    h = ad.differentiate_with(model, TORCH)
    ran: list[str] = []
    original = ad.prepare

    def prepare(op, f, *args, **kwargs):
        prepared = original(op, f, *args, **kwargs)

        def counted(*a, **k):
            ran.append(op.__name__)
            return prepared(*a, **k)

        return counted

    monkeypatch.setattr(ad, "prepare", prepare)
    x, t = xs[0], xs[1]
    jax.block_until_ready(jax.jit(jax.grad(lambda v: jnp.sum(h(v) ** 2)))(x))
    jax.block_until_ready(jax.grad(lambda v: jnp.sum(jax.jit(h)(v) ** 2))(x))
    assert ran == ["pullback", "pullback"]
    ran.clear()
    jax.block_until_ready(jax.jvp(jax.jit(h), (x,), (t,)))
    jax.block_until_ready(jax.jit(lambda a, b: jax.jvp(h, (a,), (b,)))(x, t))
    assert ran == ["pushforward", "pushforward"]


def test_scipy_erf_reverse_over_forward():
    """jax.grad of a jvp's tangent: the pullback of the pushforward (finite differences of
    finite differences), against erf's analytic second derivative."""
    h = ad.differentiate_with(scipy.special.erf, FD)
    x, t = jnp.array([-0.7, 0.2, 1.1]), jnp.array([1.0, -2.0, 0.5])
    xn, tn = np.asarray(x, np.float64), np.asarray(t, np.float64)
    got = jax.jit(jax.grad(lambda v: jnp.sum(jax.jvp(h, (v,), (t,))[1])))(x)
    assert_tree_allclose(got, erf_second(xn) * tn, rtol=1e-4, atol=1e-5)


def test_torch_parameters_as_jax_arrays_through_ad_gradient(model, xs):
    """The parameters are JAX arrays, passed to a torch function: JAX trains a torch model."""
    params = jax_params(model)

    def g(p: dict, x: torch.Tensor) -> torch.Tensor:
        return torch.sum(torch_mlp_of(p, x) ** 2)

    h = ad.differentiate_with(g, TORCH)
    loss = lambda p, x: h(p, Constant(x))  # noqa: E731
    expected = jax.grad(lambda p: jnp.sum(jax_mlp(p, xs) ** 2))(params)
    assert_tree_allclose(ad.gradient(loss, Active(params), Constant(xs), backend=ad.AutoJAX()), expected,
                         rtol=RTOL, atol=ATOL)
    prepared = ad.prepare(ad.gradient, loss, Active(params), Constant(xs), backend=ad.AutoJAX())
    assert_tree_allclose(prepared(params, xs), expected, rtol=RTOL, atol=ATOL)


def test_constant_is_data_and_cache_is_scratch(xs):
    asked = []

    def g(x: torch.Tensor, scale: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        asked.append(scale.requires_grad)
        buffer.copy_(x * scale)  # written, then read back: the derivative flows through it
        return torch.sum(buffer * x)

    h = ad.differentiate_with(g, TORCH)
    x, scale = xs[0], xs[1]

    scratch = jnp.zeros(3)

    def loss(x: jax.Array, scale: jax.Array) -> jax.Array:
        return h(Active(x), Constant(scale), Cache(scratch))

    grad_x, grad_scale = jax.grad(loss, argnums=(0, 1))(x, scale)
    assert_tree_allclose(grad_x, 2 * x * scale, rtol=RTOL, atol=ATOL)
    assert_tree_allclose(grad_scale, jnp.zeros(3), rtol=0, atol=0)  # a Constant: not differentiated
    assert not any(asked)  # g never saw a Constant that torch would differentiate
    assert_tree_allclose(jax.jit(loss)(x, scale), jnp.sum(x * scale * x), rtol=RTOL, atol=ATOL)
    assert not jnp.any(scratch)  # g wrote into copies, never into the buffer JAX owns
    only_data = lambda c: h(Constant(c), Constant(scale), Cache(scratch)) + jnp.sum(c)  # noqa: E731
    assert_tree_allclose(jax.grad(only_data)(x), jnp.ones(3), rtol=0, atol=0)
    assert_tree_allclose(jax.jvp(only_data, (x,), (scale,))[1], jnp.sum(scale), rtol=RTOL, atol=ATOL)
    assert_tree_allclose(jax.jvp(lambda v: loss(v, scale), (x,), (scale,))[1], jnp.sum(2 * x * scale**2),
                         rtol=RTOL, atol=ATOL)


def test_pytree_arguments_outputs_and_has_aux(xs):
    def g(inputs: dict, index: torch.Tensor) -> tuple[dict, dict]:
        a, b = inputs["a"], inputs["pair"][0]
        out = {"sum": torch.sum(a * b), "gathered": (a[index] ** 2,)}
        return out, {"norm": torch.linalg.norm(a), "count": torch.tensor(3)}

    h = ad.differentiate_with(g, TORCH, has_aux=True)
    a, b = xs[0], xs[1]
    index = jnp.array([2, 0])

    def loss(a: jax.Array, b: jax.Array) -> tuple[jax.Array, dict]:
        out, aux = h({"a": a, "pair": (b, "a label")}, Constant(index))
        return out["sum"] + jnp.sum(out["gathered"][0]), aux

    (value, aux), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(a, b)
    expected_grad_a = b.at[index].add(2 * a[index])
    assert_tree_allclose(value, jnp.sum(a * b) + jnp.sum(a[index] ** 2), rtol=RTOL, atol=ATOL)
    assert_tree_allclose(grads, (expected_grad_a, a), rtol=RTOL, atol=ATOL)
    assert_tree_allclose(aux["norm"], jnp.linalg.norm(a), rtol=RTOL, atol=ATOL)
    assert int(aux["count"]) == 3 and aux["count"].dtype == jnp.int32


# ------------------------------------------------------------------ numpy / SciPy inside JAX


def test_scipy_erf_in_jax_first_and_second_order():
    h = ad.differentiate_with(scipy.special.erf, FD)
    x = jnp.array([-1.2, 0.1, 0.5, 2.0])
    xn = np.asarray(x, dtype=np.float64)
    assert_tree_allclose(jax.jit(jax.grad(lambda v: jnp.sum(h(v))))(x), erf_prime(xn), rtol=1e-5, atol=1e-6)
    assert_tree_allclose(jax.vmap(jax.grad(h))(x), erf_prime(xn), rtol=1e-5, atol=1e-6)
    assert_tree_allclose(jax.jvp(h, (x,), (jnp.ones(4),))[1], erf_prime(xn), rtol=1e-5, atol=1e-6)
    assert_tree_allclose(jax.jacrev(h)(x), np.diag(erf_prime(xn)), rtol=1e-5, atol=1e-6)
    hessian = jax.hessian(lambda v: jnp.sum(h(v)))(x)
    assert_tree_allclose(hessian, np.diag(erf_second(xn)), rtol=1e-4, atol=1e-5)
    # reverse over reverse: finite differences of finite differences
    assert_tree_allclose(jax.jacrev(jax.grad(lambda v: jnp.sum(h(v))))(x), np.diag(erf_second(xn)),
                         rtol=1e-4, atol=1e-5)


def _decay(k: np.ndarray, y0: np.ndarray, t_end: float) -> np.ndarray:
    """y(t_end) for dy/dt = -k y, y(0) = y0 (one equation per entry), by SciPy's solver."""
    solution = scipy.integrate.solve_ivp(lambda t, y: -k * y, (0.0, t_end), y0, rtol=1e-12, atol=1e-12,
                                         method="DOP853")
    return solution.y[:, -1]


def test_scipy_ode_solution_in_jax_grad():
    jax_x64 = jax.config.jax_enable_x64
    h = ad.differentiate_with(_decay, FD)
    k, y0, t_end = jnp.array([0.5, 1.5]), jnp.array([2.0, -1.0]), 1.3

    def loss(k: jax.Array, y0: jax.Array) -> jax.Array:
        return jnp.sum(h(k, y0, Constant(t_end)) ** 2)

    kn, yn = np.asarray(k, np.float64), np.asarray(y0, np.float64)
    exact_y = yn * np.exp(-kn * t_end)  # closed form; d y / d k = -t y, d y / d y0 = exp(-k t)
    grad_k, grad_y0 = jax.jit(jax.grad(loss, argnums=(0, 1)))(k, y0)
    assert_tree_allclose(grad_k, 2 * exact_y * (-t_end * exact_y), rtol=1e-4, atol=1e-6)
    assert_tree_allclose(grad_y0, 2 * exact_y * np.exp(-kn * t_end), rtol=1e-4, atol=1e-6)
    assert jax.config.jax_enable_x64 == jax_x64


# ------------------------------------------------------------------ JAX / numpy inside torch


def test_jax_model_in_torch_backward_and_second_order(model):
    params_jax = jax_params(model)
    h = ad.differentiate_with(jax_mlp, ad.AutoJAX())
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    params = {name: torch.from_numpy(np.array(p)).requires_grad_(True) for name, p in params_jax.items()}
    reference = {name: p.detach().clone().requires_grad_(True) for name, p in params.items()}
    xr = x.clone().requires_grad_(True)
    xh = x.clone().requires_grad_(True)
    torch.sum(torch.sin(h(params, xh))).backward()
    torch.sum(torch.sin(torch_mlp_of(reference, xr))).backward()
    assert_tree_allclose({n: p.grad for n, p in params.items()}, {n: p.grad for n, p in reference.items()},
                         rtol=RTOL, atol=ATOL)
    assert_tree_allclose(xh.grad, xr.grad, rtol=RTOL, atol=ATOL)
    # second order: backward of backward (create_graph), reverse over reverse in JAX
    (g1,) = torch.autograd.grad(torch.sum(h(params, xh) ** 3), xh, create_graph=True)
    (g2,) = torch.autograd.grad(torch.sum(g1 * xh), xh)
    (r1,) = torch.autograd.grad(torch.sum(torch_mlp_of(reference, xr) ** 3), xr, create_graph=True)
    (r2,) = torch.autograd.grad(torch.sum(r1 * xr), xr)
    assert_tree_allclose(g2, r2, rtol=1e-4, atol=1e-5)


def test_jax_function_under_torch_func_transforms(model):
    params_jax = jax_params(model)
    h = ad.differentiate_with(lambda x: jnp.sum(jnp.tanh(jax_mlp(params_jax, x))), ad.AutoJAX())
    params = {name: torch.from_numpy(np.array(p)) for name, p in params_jax.items()}
    reference = lambda x: torch.sum(torch.tanh(torch_mlp_of(params, x)))  # noqa: E731
    x = torch.randn(3, generator=torch.Generator().manual_seed(2))
    batch = torch.randn(4, 3, generator=torch.Generator().manual_seed(3))
    func = torch.func
    assert_tree_allclose(func.grad(h)(x), func.grad(reference)(x), rtol=RTOL, atol=ATOL)
    assert_tree_allclose(func.jvp(h, (x,), (batch[0],)), func.jvp(reference, (x,), (batch[0],)), rtol=RTOL, atol=ATOL)
    assert_tree_allclose(func.vmap(func.grad(h))(batch), func.vmap(func.grad(reference))(batch), rtol=RTOL, atol=ATOL)
    assert_tree_allclose(func.vmap(h)(batch), func.vmap(reference)(batch), rtol=RTOL, atol=ATOL)
    assert_tree_allclose(func.hessian(h)(x), func.hessian(reference)(x), rtol=1e-4, atol=1e-5)
    vector = ad.differentiate_with(lambda v: jnp.tanh(jax_mlp(params_jax, v)), ad.AutoJAX())
    vector_reference = lambda v: torch.tanh(torch_mlp_of(params, v))  # noqa: E731
    assert_tree_allclose(func.jacrev(vector)(x), func.jacrev(vector_reference)(x), rtol=RTOL, atol=ATOL)
    assert_tree_allclose(func.jacfwd(vector)(x), func.jacfwd(vector_reference)(x), rtol=RTOL, atol=ATOL)
    assert_tree_allclose(ad.gradient(lambda v: h(v) ** 2, Active(x), backend=TORCH),
                         func.grad(lambda v: reference(v) ** 2)(x), rtol=RTOL, atol=ATOL)


def test_scipy_erf_in_torch_autograd_first_and_second_order():
    h = ad.differentiate_with(scipy.special.erf, FD)
    x = torch.tensor([-1.2, 0.1, 0.5, 2.0], dtype=torch.float64, requires_grad=True)
    xn = x.detach().numpy()
    (first,) = torch.autograd.grad(torch.sum(h(x)), x, create_graph=True)
    assert_tree_allclose(first, erf_prime(xn), rtol=1e-7, atol=1e-9)
    (second,) = torch.autograd.grad(torch.sum(first), x)
    assert_tree_allclose(second, erf_second(xn), rtol=1e-5, atol=1e-7)
    assert_tree_allclose(torch.func.jvp(h, (x.detach(),), (torch.ones(4, dtype=torch.float64),))[1],
                         erf_prime(xn), rtol=1e-7, atol=1e-9)


def test_torch_constant_and_has_aux():
    def g(x: jax.Array, c: jax.Array) -> tuple[jax.Array, jax.Array]:
        return jnp.sum(x * c), jnp.max(c)

    h = ad.differentiate_with(g, ad.AutoJAX(), has_aux=True)
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    c = torch.tensor([3.0, 5.0], requires_grad=True)
    value, aux = h(Active(x), Constant(c))
    value.backward()
    assert_tree_allclose(x.grad, c.detach(), rtol=0, atol=0)
    assert c.grad is None  # a Constant: not differentiated
    assert float(aux) == 5.0 and not aux.requires_grad


# ------------------------------------------------------------------ limits and errors


def test_higher_orders_raise_unsupported(model, xs):
    h = ad.differentiate_with(lambda x: torch.sum(torch.sin(x)), TORCH)
    x = xs[0]
    with pytest.raises(UnsupportedError, match="order 3"):
        jax.jacfwd(jax.hessian(h))(x)
    with pytest.raises(UnsupportedError, match="reverse-over-reverse"):
        jax.jacrev(jax.grad(h))(x)
    with pytest.raises(UnsupportedError, match="reverse-over-forward"):
        jax.grad(lambda v: jnp.sum(jax.jvp(h, (v,), (v,))[1]))(x)
    ht = ad.differentiate_with(lambda x: jnp.sum(jnp.sin(x)), ad.AutoJAX())
    xt = torch.tensor([0.1, 0.2], requires_grad=True)
    (g1,) = torch.autograd.grad(ht(xt), xt, create_graph=True)
    (g2,) = torch.autograd.grad(g1.sum(), xt, create_graph=True)
    with pytest.raises(UnsupportedError, match="order 3"):
        torch.autograd.grad(g2.sum(), xt)


class _Boom(ValueError):
    pass


def _fails(x):
    raise _Boom("g failed on purpose")


def test_errors_of_g_propagate_with_a_note(xs):
    for backend, x in ((TORCH, xs[0]), (FD, xs[0])):
        h = ad.differentiate_with(_fails, backend)
        for run in (lambda: h(x), lambda: jax.grad(lambda v: jnp.sum(h(v)))(x)):
            with pytest.raises(_Boom) as caught:
                run()
            notes = "\n".join(getattr(caught.value, "__notes__", []))
            assert "differentiate_with(_fails" in notes and type(backend).__name__ in notes
        with pytest.raises(Exception, match="differentiate_with") as caught:
            jax.jit(h)(x)  # under jit JAX raises its own error, carrying g's traceback and the note
        assert "g failed on purpose" in str(caught.value)
    ht = ad.differentiate_with(_fails, ad.AutoJAX())
    with pytest.raises(_Boom) as caught:
        ht(torch.ones(2, requires_grad=True))
    assert "AutoJAX" in "\n".join(caught.value.__notes__)


def test_mistakes_get_errors_that_say_what_to_do():
    h = ad.differentiate_with(lambda x: x, TORCH)
    with pytest.raises(TypeError, match="both JAX arrays and torch tensors"):
        h(jnp.ones(2), Constant(torch.ones(2)))
    with pytest.raises(TypeError, match="call g itself"):
        h(np.ones(2))
    with pytest.raises(TypeError, match="activity backend"):
        ad.differentiate_with(lambda x: x, "torch")


# ------------------------------------------------------------------ cost and nothing lost


def test_inner_operator_prepared_once_per_signature(model, xs, monkeypatch):
    prepared = []
    original = ad.prepare
    monkeypatch.setattr(ad, "prepare", lambda *a, **k: prepared.append(a[0].__name__) or original(*a, **k))
    h = ad.differentiate_with(model, TORCH)
    loss = lambda x: jnp.sum(h(x) ** 2)  # noqa: E731
    gradient = jax.jit(jax.grad(loss))
    h(xs)
    jax.grad(loss)(xs)
    for scale in (1.0, 2.0, 3.0):
        gradient(scale * xs)
    assert prepared == ["pullback"]  # eager, jax.grad and jit share one signature
    gradient(xs[:2])  # a new shape: one more
    assert prepared == ["pullback", "pullback"]


def test_nothing_lost(xs):
    model = torch_mlp()
    model.train()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    flags = [p.requires_grad for p in model.parameters()]
    rng = torch.get_rng_state()
    grad_mode = torch.is_grad_enabled()
    h = ad.differentiate_with(model, TORCH)
    jax.hessian(lambda x: jnp.sum(jnp.tanh(h(x))))(xs[0])
    jax.jit(jax.vmap(jax.grad(lambda x: jnp.sum(h(x)))))(xs)
    assert all(p.grad is None for p in model.parameters())
    assert [p.requires_grad for p in model.parameters()] == flags and model.training
    assert_tree_allclose(dict(model.named_parameters()), before, rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), rng) and torch.is_grad_enabled() == grad_mode

    x = torch.tensor([0.3, 0.7], requires_grad=True)
    kept = x.detach().clone()
    ht = ad.differentiate_with(lambda v: jnp.sum(v**2), ad.AutoJAX())
    ht(x).backward()
    assert torch.equal(x.detach(), kept) and x.requires_grad
    assert_tree_allclose(x.grad, 2 * kept, rtol=RTOL, atol=ATOL)


def test_hugging_face_gpt2_inside_jax_grad():
    """A transformers model as users build it (tiny config, eval mode) inside `jax.jit(jax.grad)`,
    against torch's own gradient of the same loss with respect to the input embeddings."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=2, n_head=2)
    gpt2 = transformers.GPT2Model(config).eval()
    embeds = torch.randn(2, 5, 16)

    def hidden(e: torch.Tensor) -> torch.Tensor:
        return gpt2(inputs_embeds=e).last_hidden_state

    h = ad.differentiate_with(hidden, TORCH)
    got = jax.jit(jax.grad(lambda e: jnp.sum(jnp.tanh(h(e)) ** 2)))(jnp.asarray(embeds.numpy()))
    leaf = embeds.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad((torch.tanh(hidden(leaf)) ** 2).sum(), leaf)
    assert_tree_allclose(np.asarray(got), expected.numpy(), rtol=1e-4, atol=1e-5)
    assert all(p.grad is None for p in gpt2.parameters())


def test_equinox_model_inside_torch_backward():
    """An Equinox MLP (a JAX pytree with activation functions as fields) inside a torch loss,
    against `jax.grad` of the same loss."""
    import equinox as eqx

    mlp = eqx.nn.MLP(3, 2, width_size=8, depth=2, key=jax.random.PRNGKey(0))
    h = ad.differentiate_with(lambda v: jax.vmap(mlp)(v), ad.AutoJAX())
    x = torch.randn(4, 3, dtype=torch.float32, requires_grad=True)
    (torch.sin(h(x)) ** 2).sum().backward()
    expected = jax.grad(lambda v: jnp.sum(jnp.sin(jax.vmap(mlp)(v)) ** 2))(jnp.asarray(x.detach().numpy()))
    assert_tree_allclose(x.grad.numpy(), np.asarray(expected), rtol=1e-5, atol=1e-6)


def test_an_output_shape_that_changes_with_the_values_is_an_error():
    """Under jit the output shapes come from a first call; a g whose shape depends on the values
    must raise, not have its result broadcast to the announced shape."""

    def g(x: np.ndarray) -> np.ndarray:
        return np.repeat(np.sum(x), 1 if x[0] > 0 else 3)

    h = ad.differentiate_with(g, FD)
    with pytest.raises(Exception, match=r"shape \(1,\) where its first call gave \(3,\)"):
        jax.block_until_ready(jax.jit(h)(jnp.ones(2)))


# ---------------------------------------------------------------- what must not give zeros or stale numbers


def test_complex_arrays_are_refused_rather_than_given_a_zero_derivative():
    doubled = ad.differentiate_with(lambda z: z * 2, ad.AutoTorch())
    with pytest.raises(UnsupportedError, match="complex"):
        jax.grad(lambda z: jnp.real(doubled(z)).sum())(jnp.ones(2, dtype=jnp.complex64))
    to_complex = ad.differentiate_with(lambda x: torch.complex(x, x), ad.AutoTorch())
    with pytest.raises(UnsupportedError, match="complex"):
        jax.grad(lambda x: jnp.real(to_complex(x)).sum())(jnp.ones(2))


def test_a_mask_is_refused_rather_than_ignored():
    h = ad.differentiate_with(lambda p: (p["w"] * p["b"]).sum(), ad.AutoTorch())
    p = {"w": jnp.ones(2), "b": jnp.full(2, 3.0)}
    with pytest.raises(UnsupportedError, match="where="):
        jax.grad(lambda p: h(Active(p, where={"w": True, "b": False})))(p)
    # the way it says: the selected part as its own Active argument, the rest Constant
    split = ad.differentiate_with(lambda w, b: (w * b).sum(), ad.AutoTorch())
    np.testing.assert_allclose(jax.grad(lambda w: split(w, Constant(p["b"])))(p["w"]), p["b"])


def test_a_mutable_non_array_argument_a_jax_g_reads_is_warned_of():
    """AutoJAX compiles the inner operator once per signature: a change inside an object g
    reads would reach g's value but not its derivatives, so it is warned of at that signature."""

    class Scale:
        def __init__(self, values):
            self.values = values

    h = ad.differentiate_with(lambda x, scale: jnp.sum(x * jnp.asarray(scale.values)), ad.AutoJAX())
    x = torch.ones(2, requires_grad=True)
    with pytest.warns(UserWarning, match="can change in place"):
        h(x, Constant(Scale([2.0, 3.0]))).backward()
    torch.testing.assert_close(x.grad, torch.tensor([2.0, 3.0]))


def test_a_numpy_g_writing_into_its_cache_works_when_first_called_under_jit():
    def g(x, scratch):
        scratch[:] = x * 3.0  # writes into the Cache, then reads it back
        return np.sum(scratch**2)

    h = ad.differentiate_with(g, ad.AutoFiniteDifferences())
    x = jnp.array([1.0, -2.0])
    got = jax.jit(jax.grad(lambda v: h(v, Cache(jnp.zeros(2)))))(x)
    np.testing.assert_allclose(got, 18.0 * np.asarray(x), rtol=1e-4)

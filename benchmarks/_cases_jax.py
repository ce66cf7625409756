"""JAX cases: prepared `activity` calls against `jax.jit` of the matching transform.

Parameters are dicts of arrays and the data is an explicit argument of every
function, so both sides compile the same computation; every timed call has its
result computed when it returns (see `blocked`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import activity as ad
from activity import Active, Constant

from ._case import EQUINOX_TARGET, FIRST_ORDER_TARGET, PREPARED, SCALING, UNPREPARED, Case

FRAMEWORK = "jax"
BATCH = 32


def blocked(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[[], Any]:
    """``fn(*args, **kwargs)`` as a timed call whose result is computed when it returns.

    With JAX's default asynchronous dispatch a call returns before its result is
    computed, so the timed call blocks on it (`jax.block_until_ready`). The harness
    runs with synchronous CPU dispatch, where the call itself computes the result:
    then, once its arrays are seen ready on return, the bare call is timed. Blocking
    there would time a walk over the result's containers, which differ between the
    sides of a case (a mask's ``None`` leaves against a two-key dict) while the
    computation does not.
    """
    call = functools.partial(fn, *args, **kwargs)
    if jax.config.read("jax_cpu_enable_async_dispatch") or not _returns_ready(call):
        return lambda: jax.block_until_ready(call())
    return call


def _returns_ready(call: Callable[[], Any]) -> bool:
    arrays = [leaf for leaf in jax.tree.leaves(call()) if isinstance(leaf, jax.Array)]
    return bool(arrays) and all(array.is_ready() for array in arrays)


def _normal(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype=jnp.float32)


def parameter_count(params: Any) -> int:
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(params))


# --- models -------------------------------------------------------------------------------


def mlp_params(width: int, seed: int = 0) -> dict[str, jax.Array]:
    """Two tanh hidden layers of ``width`` on inputs of ``width``, one output."""
    rng = np.random.default_rng(seed)
    scale = 1.0 / np.sqrt(width)
    return {
        "w1": _normal(rng, width, width, scale=scale), "b1": jnp.zeros(width),
        "w2": _normal(rng, width, width, scale=scale), "b2": jnp.zeros(width),
        "w3": _normal(rng, width, 1, scale=scale), "b3": jnp.zeros(1),
    }


def mlp(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    h = jnp.tanh(h @ params["w2"] + params["b2"])
    return h @ params["w3"] + params["b3"]


def mse(model):
    def loss(params, x):
        return jnp.mean(model(params, x) ** 2)

    return loss


def cnn_params(seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    return {
        "c1": _normal(rng, 4, 1, 3, 3, scale=1 / 3), "c2": _normal(rng, 8, 4, 3, 3, scale=1 / 6),
        "w": _normal(rng, 8 * 8 * 8, 1, scale=1 / 23), "b": jnp.zeros(1),
    }


def cnn(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """16x16 single-channel images: conv 3x3 (4), conv 3x3 stride 2 (8), linear."""
    conv = lambda a, w, stride: jax.lax.conv_general_dilated(  # noqa: E731
        a, w, (stride, stride), ((1, 1), (1, 1)), dimension_numbers=("NCHW", "OIHW", "NCHW"))
    h = jnp.tanh(conv(x, params["c1"], 1))
    h = jnp.tanh(conv(h, params["c2"], 2))
    return h.reshape(h.shape[0], -1) @ params["w"] + params["b"]


LSTM_INPUT, LSTM_HIDDEN, LSTM_STEPS = 8, 32, 10


def lstm_params(seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    scale = 1.0 / np.sqrt(LSTM_HIDDEN)
    return {
        "wi": _normal(rng, LSTM_INPUT, 4 * LSTM_HIDDEN, scale=scale),
        "wh": _normal(rng, LSTM_HIDDEN, 4 * LSTM_HIDDEN, scale=scale),
        "b": jnp.zeros(4 * LSTM_HIDDEN),
        "head_w": _normal(rng, LSTM_HIDDEN, 1, scale=scale), "head_b": jnp.zeros(1),
    }


def lstm(params: dict[str, jax.Array], xs: jax.Array) -> jax.Array:
    """An LSTM over ``xs`` of shape (steps, batch, input), a linear head on the last hidden state."""

    def cell(carry, x):
        h, c = carry
        i, f, g, o = jnp.split(x @ params["wi"] + h @ params["wh"] + params["b"], 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), None

    zeros = jnp.zeros((xs.shape[1], LSTM_HIDDEN))
    (h, _), _ = jax.lax.scan(cell, (zeros, zeros), xs)
    return h @ params["head_w"] + params["head_b"]


def vector_problem(n: int, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    return _normal(rng, n), _normal(rng, n, n, scale=1.0 / np.sqrt(n))


def vector_map(v: jax.Array, a: jax.Array) -> jax.Array:
    return jnp.tanh(a @ v)


def vector_loss(v: jax.Array, a: jax.Array) -> jax.Array:
    return jnp.sum(jnp.tanh(a @ v) ** 2)


# --- cases --------------------------------------------------------------------------------


def _gradient_case(model_name, loss, params, x, size_label, family=PREPARED) -> Case:
    prepared = ad.prepare(ad.gradient, loss, Active(params), Constant(x))
    return Case(
        FRAMEWORK, "gradient", family, model_name, parameter_count(params), size_label,
        raw=blocked(jax.jit(jax.grad(loss)), params, x),
        ours=blocked(prepared, params, x),
        target=FIRST_ORDER_TARGET,
    )


def mlp_data(width: int, seed: int = 1) -> jax.Array:
    return _normal(np.random.default_rng(seed), BATCH, width)


def prepared_cases(mlp_widths, vector_sizes, networks: bool = True) -> list[Case]:
    cases = []
    for width in mlp_widths:
        params, x = mlp_params(width), mlp_data(width)
        label = f"width {width}"
        cases.append(_gradient_case("MLP", mse(mlp), params, x, label))

        cotangent = jnp.ones((BATCH, 1))
        pullback = ad.prepare(ad.pullback, mlp, Active(params), Constant(x), cotangent=cotangent)
        raw_pullback = jax.jit(lambda p, x, ct: jax.vjp(lambda p: mlp(p, x), p)[1](ct)[0])
        cases.append(Case(
            FRAMEWORK, "pullback", PREPARED, "MLP", parameter_count(params), label,
            raw=blocked(raw_pullback, params, x, cotangent),
            ours=blocked(pullback, params, x, cotangent=cotangent),
            target=FIRST_ORDER_TARGET,
        ))

        tangent = jax.tree.map(jnp.ones_like, params)
        pushforward = ad.prepare(ad.pushforward, mlp, Active(params), Constant(x), tangent=tangent)
        raw_pushforward = jax.jit(lambda p, x, t: jax.jvp(lambda p: mlp(p, x), (p,), (t,))[1])
        cases.append(Case(
            FRAMEWORK, "pushforward", PREPARED, "MLP", parameter_count(params), label,
            raw=blocked(raw_pushforward, params, x, tangent),
            ours=blocked(pushforward, params, x, tangent=tangent),
            target=FIRST_ORDER_TARGET,
        ))

    if networks:
        cases += equinox_cases(((1, 16), (8, 16), (8, 256)) if max(mlp_widths) > 16 else ((1, 4), (2, 4)))
        images = _normal(np.random.default_rng(1), BATCH, 1, 16, 16)
        cases.append(_gradient_case("CNN", mse(cnn), cnn_params(), images, "16x16 images"))
        sequences = _normal(np.random.default_rng(1), LSTM_STEPS, BATCH, LSTM_INPUT)
        cases.append(_gradient_case("LSTM", mse(lstm), lstm_params(), sequences, f"{LSTM_STEPS} steps"))

    for n in vector_sizes:
        v, a = vector_problem(n)
        label = f"n {n}"
        jacobian = ad.prepare(ad.jacobian, vector_map, Active(v), Constant(a))
        cases.append(Case(
            FRAMEWORK, "jacobian", PREPARED, "tanh(A v)", n, label,
            raw=blocked(jax.jit(jax.jacrev(vector_map)), v, a),
            ours=blocked(jacobian, v, a),
            target=FIRST_ORDER_TARGET,
        ))
        hessian = ad.prepare(ad.hessian, vector_loss, Active(v), Constant(a))
        cases.append(Case(
            FRAMEWORK, "hessian", PREPARED, "sum tanh(A v)^2", n, label,
            raw=blocked(jax.jit(jax.hessian(vector_loss)), v, a),
            ours=blocked(hessian, v, a),
            target=FIRST_ORDER_TARGET,
        ))
        t = jnp.ones(n)
        hvp = ad.prepare(ad.hvp, vector_loss, Active(v), Constant(a), tangent=t)
        raw_hvp = jax.jit(lambda v, a, t: jax.jvp(lambda v: jax.grad(vector_loss)(v, a), (v,), (t,))[1])
        cases.append(Case(
            FRAMEWORK, "hvp", PREPARED, "sum tanh(A v)^2", n, label,
            raw=blocked(raw_hvp, v, a, t),
            ours=blocked(hvp, v, a, tangent=t),
            target=FIRST_ORDER_TARGET,
        ))
    return cases


def equinox_cases(shapes) -> list[Case]:
    """``Active(eqx.nn.MLP)`` prepared against ``eqx.filter_jit(eqx.filter_grad(loss))``, for
    (depth, width) in ``shapes``; nothing where Equinox is not installed."""
    try:
        import equinox as eqx
    except ImportError:
        return []

    def loss(model, x):
        return jnp.mean(jax.vmap(model)(x) ** 2)

    raw_gradient = eqx.filter_jit(eqx.filter_grad(loss))
    cases = []
    for depth, width in shapes:
        model = eqx.nn.MLP(width, 1, width, depth, key=jax.random.PRNGKey(0))
        x = mlp_data(width)
        prepared = ad.prepare(ad.gradient, loss, Active(model), Constant(x))
        cases.append(Case(
            FRAMEWORK, "gradient", PREPARED, "Equinox MLP", parameter_count(eqx.filter(model, eqx.is_array)),
            f"depth {depth}, width {width}",
            raw=blocked(raw_gradient, model, x),
            ours=blocked(prepared, model, x),
            target=EQUINOX_TARGET, raw_name="`eqx.filter_jit(eqx.filter_grad(f))`",
        ))
    return cases


def unprepared_cases(mlp_widths) -> list[Case]:
    """Without `prepare` against the raw transforms without `jax.jit` (eager, op by op)."""
    cases = []
    backend = ad.AutoJAX()
    for width in mlp_widths:
        params, x = mlp_params(width), mlp_data(width)
        loss, label, size = mse(mlp), f"width {width}", parameter_count(params)
        cases.append(Case(
            FRAMEWORK, "gradient", UNPREPARED, "MLP", size, label,
            raw=blocked(jax.grad(loss), params, x),
            ours=blocked(ad.gradient, loss, Active(params), Constant(x), backend=backend),
        ))
        cotangent = jnp.ones((BATCH, 1))
        cases.append(Case(
            FRAMEWORK, "pullback", UNPREPARED, "MLP", size, label,
            raw=blocked(lambda params, x, cotangent: jax.vjp(lambda p: mlp(p, x), params)[1](cotangent)[0],
                        params, x, cotangent),
            ours=blocked(ad.pullback, mlp, Active(params), Constant(x), cotangent=cotangent, backend=backend),
        ))
    return cases


def scaling_cases(mlp_widths) -> list[Case]:
    cases = []
    for width in mlp_widths:
        params = mlp_params(width)
        case = _gradient_case("MLP", mse(mlp), params, mlp_data(width), f"width {width}", family=SCALING)
        cases.append(case)
    return cases

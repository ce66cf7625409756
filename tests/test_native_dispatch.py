"""A strict prepared JAX call served by JAX's C++ dispatch alone (`activity.backends._jax_dispatch`).

The prepared object's ``__call__`` is a ``jax.jit`` dispatch of its own: the prepared
signature runs no Python code of activity's, and its results keep the argument's dict key
order (JAX's own results sort the keys); every other call reaches activity's checked path
with the caller's arguments. Results are checked against hand-written ``jax.grad``,
``jax.vjp``, ``jax.jvp`` and ``jax.jacrev`` calls; the same checks run on the Python
``__call__`` that serves a JAX without the internals the dispatch needs.
"""

from __future__ import annotations

import copy
import functools
import gc
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import activity as ad  # noqa: E402
from activity import Active, Constant  # noqa: E402
from activity.backends import _jax as jax_backend  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-6)
# JAX 0.7 cannot make a treedef of dict keys in a given order: there a result of dicts
# keeps one Python frame (its rebuild), and only results JAX builds as they are skip it.
ORDERED_TREEDEFS = hasattr(jax.tree_util.tree_structure(0), "from_node_data_and_children")
ACTIVITY = str(Path(ad.__file__).parent)


def params() -> dict:
    """Nested keys out of sorted order, a list and a None: JAX's own result would sort the keys."""
    return {"w": {"z": jnp.linspace(0.1, 0.9, 3), "b": jnp.asarray([0.2])}, "layers": [jnp.asarray(0.5), None], "a": jnp.asarray(1.5)}


def loss(p, x):
    return jnp.sum(jnp.tanh(p["w"]["z"] * x + p["w"]["b"]) ** 2) * p["a"] + p["layers"][0] ** 2 * jnp.sum(x)


def model(p, x):
    return {"y": jnp.tanh(p["w"]["z"] * x) * p["a"], "c": p["w"]["b"] * p["layers"][0]}


def key_order(tree) -> list:
    """Every dict's keys, depth first, in their order."""
    if isinstance(tree, dict):
        return [list(tree), *(key_order(value) for value in tree.values())]
    if isinstance(tree, (list, tuple)):
        return [key_order(value) for value in tree]
    return []


def assert_same(got, want) -> None:
    """``got`` in ``params()``'s key order, holding ``want``'s values (compared by key)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want)
        for key in want:
            assert_same(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
    elif want is None:
        assert got is None
    else:
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


@pytest.fixture(params=["native", "python"])
def dispatch(request, monkeypatch):
    """Each test on both: JAX's dispatch, and the Python `__call__` of a JAX without its internals."""
    if request.param == "python":
        monkeypatch.setattr(jax_backend, "native_call", lambda *args: None)
    return request.param


def data(seed: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(3), dtype=jnp.float32)


def python_frames(call) -> list[str]:
    """The Python functions that run during ``call()`` (a C callable: none of its own)."""
    seen: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            seen.append(f"{frame.f_code.co_filename}:{frame.f_code.co_qualname}")

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


def test_each_operator_gives_the_raw_result_in_the_arguments_key_order(dispatch):
    p, x0 = params(), jnp.ones(3)
    tangent = jax.tree.map(jnp.ones_like, p)
    cotangent = {"y": jnp.asarray([1.0, -2.0, 0.5]), "c": jnp.asarray([3.0])}
    gradient = ad.prepare(ad.gradient, loss, Active(p), Constant(x0))
    value_and_gradient = ad.prepare(ad.value_and_gradient, loss, Active(p), Constant(x0))
    pullback = ad.prepare(ad.pullback, model, Active(p), Constant(x0), cotangent=cotangent)
    pushforward = ad.prepare(ad.pushforward, model, Active(p), Constant(x0), tangent=tangent)
    jacobian = ad.prepare(ad.jacobian, lambda v, x: jnp.tanh(v * x), Active(x0), Constant(x0))
    for seed in range(3):  # the first call fills JAX's cache, the later ones are served from it
        x = data(seed)
        want_grad = jax.grad(loss)(p, x)
        assert_same(gradient(p, x), want_grad)
        assert key_order(gradient(p, x)) == key_order(p)
        value, grad = value_and_gradient(p, x)
        assert_same(value, loss(p, x))
        assert_same(grad, want_grad) and key_order(grad) == key_order(p)
        got = pullback(p, x, cotangent=cotangent)
        assert_same(got, jax.vjp(lambda p: model(p, x), p)[1](cotangent)[0])
        assert key_order(got) == key_order(p)
        got = pushforward(p, x, tangent=tangent)
        assert_same(got, jax.jvp(lambda p: model(p, x), (p,), (tangent,))[1])
        assert list(got) == ["y", "c"]  # f's own key order
        assert_same(jacobian(x, x), jax.jacrev(lambda v: jnp.tanh(v * x))(x))
    if dispatch == "native" and ORDERED_TREEDEFS:
        assert isinstance(type(gradient).__dict__["__call__"], staticmethod)


def test_a_prepared_call_runs_no_python_code_of_activitys():
    p, x = params(), data(0)
    of_array = ad.prepare(ad.gradient, lambda v, x: jnp.sum(jnp.tanh(v * x) ** 2), Active(x), Constant(x))
    of_array(x, x)  # the first call: JAX's cache is filled through activity's handler
    assert python_frames(functools.partial(of_array, data(1), x)) == []
    gradient = ad.prepare(ad.gradient, loss, Active(p), Constant(x))
    gradient(p, x)
    if ORDERED_TREEDEFS:  # a dict in the argument's key order, rebuilt by JAX's dispatch
        assert python_frames(functools.partial(gradient, p, data(1))) == []
    annotated = python_frames(functools.partial(gradient, Active(p), Constant(x)))
    assert any(frame.startswith(ACTIVITY) for frame in annotated)  # the checked path strips them
    with jax.disable_jit():  # JAX calls the generic path in the compiled call's place
        assert_same(gradient(p, x), jax.grad(loss)(p, x))


def test_every_other_call_is_refused_or_served_as_the_checked_path_does(dispatch):
    torch = pytest.importorskip("torch")
    p, x = params(), data(0)
    gradient = ad.prepare(ad.gradient, loss, Active(p), Constant(x))
    with pytest.raises(ad.PreparationMismatchError, match="prepared with 2 argument.*called with 1"):
        gradient(p)
    with pytest.raises(ad.PreparationMismatchError, match="argument 1.*shape"):
        gradient(p, jnp.ones(4))
    with pytest.raises(ad.PreparationMismatchError, match="argument 1"):
        gradient(p, torch.ones(3))
    with pytest.raises(ad.PreparationMismatchError, match="prepared as Active, called as Constant"):
        gradient(Constant(p), Constant(x))
    with pytest.raises(TypeError, match="tangent"):
        gradient(p, x, tangent=x)
    for error in (ad.PreparationMismatchError,):  # activity's own error, without JAX's note on removed frames
        try:
            gradient(p, jnp.ones(4))
        except error as caught:
            assert not any("JAX has removed its internal frames" in str(n) for n in getattr(caught, "__notes__", []))
    assert_same(gradient(Active(p), Constant(x)), jax.grad(loss)(p, x))
    assert_same(gradient(p, np.asarray(x)), jax.grad(loss)(p, x))  # numpy, as jax.jit takes it
    weak = ad.prepare(ad.gradient, lambda p, s: loss(p, x) * s, Active(p), Constant(jnp.float32(2.0)))
    for _ in range(2):  # a weakly typed Python float where a float32 scalar was prepared
        assert_same(weak(p, 3.0), jax.grad(lambda p: loss(p, x) * 3.0)(p))
    assert_same(gradient(p, x), jax.grad(loss)(p, x))


def test_the_prepared_call_composes_with_jax_transforms(dispatch):
    p, x = params(), data(0)
    gradient = ad.prepare(ad.gradient, loss, Active(p), Constant(x))
    xs = jnp.stack([x, data(1)])
    assert_same(jax.jit(gradient)(p, x), jax.grad(loss)(p, x))
    assert_same(jax.vmap(lambda x: gradient(p, x))(xs), jax.vmap(lambda x: jax.grad(loss)(p, x))(xs))
    second = jax.grad(lambda x: gradient(p, x)["a"])(x)
    assert_same(second, jax.grad(lambda x: jax.grad(loss)(p, x)["a"])(x))


def test_a_copy_calls_like_the_original_and_both_are_collected(dispatch):
    p, x = params(), data(0)
    prepared = ad.prepare(ad.gradient, loss, Active(p), Constant(x))
    duplicate = copy.copy(prepared)
    assert_same(duplicate(p, x), jax.grad(loss)(p, x))
    assert_same(prepared(p, x), jax.grad(loss)(p, x))
    references = weakref.ref(prepared), weakref.ref(duplicate)
    del prepared, duplicate
    gc.collect()
    assert [reference() for reference in references] == [None, None]


def test_a_call_back_into_python_keeps_the_python_call():
    """equinox.error_if's check raises while the compiled code runs: its error is explained."""
    eqx = pytest.importorskip("equinox")
    p, x = params(), data(0)

    def checked(p, x):
        return loss(p, eqx.error_if(x, x[0] > 10.0, "x[0] is too large"))

    gradient = ad.prepare(ad.gradient, checked, Active(p), Constant(x))
    assert not isinstance(type(gradient).__dict__["__call__"], staticmethod)
    assert_same(gradient(p, x), jax.grad(loss)(p, x))
    with pytest.raises(Exception, match="x\\[0\\] is too large") as caught:
        gradient(p, x + 100.0)
    assert any("runtime check inside f" in note for note in getattr(caught.value, "__notes__", []))


def test_flax_linen_and_haiku_parameters_come_back_in_their_own_key_order(dispatch):
    """Parameters as the libraries build them: Linen's ``kernel`` before ``bias``, Haiku's ``w``
    before ``b`` (JAX's own results sort both), served from JAX's dispatch after the first call."""
    nn = pytest.importorskip("flax.linen")
    hk = pytest.importorskip("haiku")

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(nn.tanh(nn.Dense(8)(x)))

    x = jnp.ones((4, 3))
    linen = MLP()
    linen_params = linen.init(jax.random.key(0), x)
    haiku = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([8, 1])(x)))
    haiku_params = haiku.init(jax.random.key(0), x)
    for apply, p in ((linen.apply, linen_params), (haiku.apply, haiku_params)):
        def loss(p, x, apply=apply):
            return jnp.sum(jnp.tanh(apply(p, x)) ** 2)

        value_and_gradient = ad.prepare(ad.value_and_gradient, loss, Active(p), Constant(x))
        for seed in range(3):
            xs = jnp.asarray(np.random.default_rng(seed).standard_normal((4, 3)), dtype=jnp.float32)
            value, grad = value_and_gradient(p, xs)
            assert_same(value, loss(p, xs))
            assert_same(grad, jax.grad(loss)(p, xs))
            assert key_order(grad) == key_order(p)

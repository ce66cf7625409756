"""A prepared operator's ``__call__`` written for its prepared call (`activity._direct_call`):
the prepared number of arguments and tangent keywords, the result rebuilt in place. Every
other shape of call (an argument missing or extra, another keyword, annotated arguments,
another signature) must behave as the generic path does: results are checked against
hand-written ``jax.jit(jax.grad)``, ``jax.vjp`` and ``torch.autograd.grad`` calls, errors by
their type and what they name."""

from __future__ import annotations

import copy
import inspect
import threading

import numpy as np
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")
import jax.numpy as jnp  # noqa: E402

import activity as ad  # noqa: E402
from activity import Active, Constant  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-6)


def params() -> dict:
    """Keys out of sorted order: JAX's own result would sort them, activity's keeps them."""
    return {"w": jnp.linspace(0.1, 0.9, 3), "b": jnp.asarray([0.2])}


def loss(p, x):
    return jnp.sum(jnp.tanh(p["w"] * x + p["b"]) ** 2)


def model(p, x):
    return jnp.tanh(p["w"] * x + p["b"])


def assert_tree_close(got, want) -> None:
    """``got`` holds ``want``'s arrays, in the order of ``params()`` (JAX's own results sort keys)."""
    assert list(got) == list(params())
    for key in want:
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), **TOL)


@pytest.fixture
def prepared_gradient():
    return ad.prepare(ad.gradient, loss, Active(params()), Constant(jnp.ones(3)))


def test_the_prepared_call_is_jax_grad_on_new_data_in_the_arguments_key_order(prepared_gradient):
    p = params()
    for seed in range(3):
        x = jnp.asarray(np.random.default_rng(seed).standard_normal(3), dtype=jnp.float32)
        want = jax.jit(jax.grad(loss))(p, x)
        got = prepared_gradient(p, x)
        assert list(got) == ["w", "b"]  # the argument's order, where JAX's result has ["b", "w"]
        assert_tree_close(got, want)
        assert_tree_close(prepared_gradient(Active(p), Constant(x)), got)


def test_a_call_of_another_shape_is_refused_as_the_generic_path_refuses_it(prepared_gradient):
    p, x = params(), jnp.ones(3)
    with pytest.raises(ad.PreparationMismatchError, match="prepared with 2 argument.*called with 1"):
        prepared_gradient(p)
    with pytest.raises(ad.PreparationMismatchError, match="prepared with 2 argument.*called with 3"):
        prepared_gradient(p, x, x)
    with pytest.raises(ad.PreparationMismatchError, match="argument 1"):
        prepared_gradient(p, jnp.ones(4))
    with pytest.raises(TypeError, match="tangent"):
        prepared_gradient(p, x, tangent=x)
    with pytest.raises(ad.PreparationMismatchError, match="argument 1"):
        prepared_gradient(p, torch.ones(3))  # JAX refuses it: the checked path names it
    with pytest.raises(ad.PreparationMismatchError):
        prepared_gradient(Constant(p), Constant(x))  # another kind
    # ... and the prepared call is served as before after each of them
    assert_tree_close(prepared_gradient(p, x), jax.grad(loss)(p, x))


def test_the_tangent_keyword_is_taken_by_name_and_its_absence_is_said():
    p, x, ct = params(), jnp.ones(3), jnp.asarray([1.0, -2.0, 0.5])
    pullback = ad.prepare(ad.pullback, model, Active(p), Constant(x), cotangent=jnp.ones(3))
    want = jax.vjp(lambda p: model(p, x), p)[1](ct)[0]
    assert_tree_close(pullback(p, x, cotangent=ct), want)
    with pytest.raises(TypeError, match="cotangent"):
        pullback(p, x)
    with pytest.raises(ValueError, match="cotangent has shape"):
        pullback(p, x, cotangent=jnp.ones(4))
    assert_tree_close(pullback(Active(p), Constant(x), cotangent=ct), want)


def test_each_prepared_object_has_its_own_call_and_stays_a_prepared():
    p, x = params(), jnp.ones(3)
    first = ad.prepare(ad.gradient, loss, Active(p), Constant(x))
    second = ad.prepare(ad.gradient, lambda p, x: jnp.sum(p["w"] * x) * p["b"][0], Active(p), Constant(x))
    assert isinstance(first, ad.Prepared) and isinstance(second, ad.Prepared)
    assert type(first).__name__ == "Prepared" and type(first) is not type(second)
    np.testing.assert_allclose(second(p, x)["b"], jnp.sum(p["w"] * x), **TOL)  # not first's f
    assert_tree_close(first(p, x), jax.grad(loss)(p, x))
    assert "self" not in inspect.signature(first).parameters  # the call's own: (*args, **seed_kwargs)


def test_a_copy_calls_like_the_original():
    p, x = params(), 2 * jnp.ones(3)
    prepared = ad.prepare(ad.gradient, loss, Active(p), Constant(jnp.ones(3)))
    duplicate = copy.copy(prepared)
    assert_tree_close(duplicate(p, x), jax.grad(loss)(p, x))
    assert_tree_close(prepared(p, x), jax.grad(loss)(p, x))


def test_threads_calling_one_prepared_object_each_get_their_own_result(prepared_gradient):
    p = params()
    xs = [jnp.full(3, float(i)) for i in range(8)]
    got: dict[int, dict] = {}

    def work(i: int) -> None:
        for _ in range(20):
            got[i] = prepared_gradient(p, xs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, x in enumerate(xs):
        assert_tree_close(got[i], jax.jit(jax.grad(loss))(p, x))  # compiled as ours is (eager tanh differs near 1)


def test_a_torch_module_prepared_on_the_meta_device_is_served_once_its_devices_are_known():
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    with torch.device("meta"):
        placeholder = torch.nn.Linear(3, 1)
    prepared = ad.prepare(ad.gradient, lambda m, x: m(x).pow(2).sum(), Active(placeholder), Constant(torch.empty(4, 3, device="meta")))
    for seed in range(3):
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))
        want = torch.autograd.grad(net(x).pow(2).sum(), list(net.parameters()))
        got = prepared(net, x)
        for (name, _), g in zip(net.named_parameters(), want):
            torch.testing.assert_close(got[name], g, **TOL)
        assert net.weight.grad is None


def test_a_result_of_namedtuples_nested_dicts_and_odd_keys_is_rebuilt_as_the_argument_is():
    import collections

    Pair = collections.namedtuple("Pair", ["first", "second"])
    p = Pair({2: jnp.asarray([0.5, -1.0]), 0: jnp.asarray(0.3)}, [{(1, "k"): jnp.asarray(2.0)}, {"z": jnp.ones(2), "a": jnp.zeros(2)}])

    def f(p, x):
        return jnp.sum(p.first[2] * x) * p.first[0] + p.second[0][(1, "k")] ** 2 + jnp.sum(p.second[1]["z"] * p.second[1]["a"] + x)

    x = jnp.asarray([1.0, 3.0])
    prepared = ad.prepare(ad.gradient, f, Active(p), Constant(x))
    got, want = prepared(p, 2 * x), jax.grad(f)(p, 2 * x)
    assert type(got) is Pair and list(got.first) == [2, 0] and list(got.second[0]) == [(1, "k")] and list(got.second[1]) == ["z", "a"]
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):  # JAX's own leaf order on both
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **TOL)

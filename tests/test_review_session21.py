"""Defects found reviewing session 21's changes, each checked against an independent answer."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import activity as ad
from activity import Active
from activity.backends._finite_differences import ReferencePrecisionWarning

torch = pytest.importorskip("torch")

FD = ad.AutoFiniteDifferences()


@pytest.mark.parametrize(
    ("f", "derivative"),
    [
        # the default first step (0.01) leaves log's domain at these points
        (lambda x: torch.log(x.float()).sum(), lambda x: 1 / x),
        (lambda x: torch.sqrt(x.float()).sum(), lambda x: 0.5 / np.sqrt(x)),
        # f varies on a scale well below float32's best step (5e-3)
        (lambda x: torch.sin(500 * x.float()).sum(), lambda x: 500 * np.cos(500 * x)),
    ],
    ids=["log-near-0", "sqrt-near-0", "fast-sine"],
)
def test_float32_f_on_a_small_scale_still_gets_smaller_steps(f, derivative):
    """The smallest step for f that rounds to float32 was a wall for every retry: where the
    steps above it could not settle (f's domain or scale is smaller), the reference gave nan or
    a derivative wrong by 100 %, where smaller steps give float32's accuracy."""
    x = np.array([0.002, 0.004])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReferencePrecisionWarning)
        got = ad.gradient(f, Active(torch.tensor(x)), backend=FD).numpy()
    want = derivative(x)
    assert np.all(np.abs(got - want) <= 1e-4 * np.abs(want)), (got, want)


class _Checked(__import__("collections").namedtuple("_Checked", "weights count")):
    """A namedtuple whose own __new__ validates its fields, as torch's PackedSequence does."""

    def __new__(cls, weights: object, count: object) -> "_Checked":
        if weights is None or count is None:
            raise TypeError("_Checked needs both fields")
        return super().__new__(cls, weights, count)


@pytest.mark.parametrize("strict", [True, False])
def test_prepared_jax_result_holding_a_validating_namedtuple(strict):
    """A gradient holds None at the integer field: JAX's own rebuild of the result (in the check
    whether JAX keeps it as built) and the rebuild of the jitted call's flat result both called
    the namedtuple's __new__ with it, so every prepared call raised the namedtuple's TypeError."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy

    def loss(p):
        return jnp.sum(p.weights**2) * p.count

    value = _Checked(jnp.arange(3.0), jnp.array(2))
    want = jax.grad(lambda w: loss(_Checked(w, value.count)))(value.weights)
    for operator in (ad.gradient, ad.value_and_gradient):
        prepared = ad.prepare(operator, loss, Active(value), strict=strict)
        for got in (prepared(value), prepared(Active(value))):
            grad = got if operator is ad.gradient else got[1]
            assert type(grad) is _Checked and grad.count is None
            np.testing.assert_allclose(np.asarray(grad.weights), np.asarray(want))
            if operator is ad.value_and_gradient:
                np.testing.assert_allclose(float(got[0]), float(loss(value)))


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_a_prepared_mismatch_is_not_chained_to_the_internal_miss(framework):
    """The strict prepared call's direct path ran the checked path inside its `except` for the
    compiled call's miss: the user's PreparationMismatchError came after "During handling of
    the above exception" and the internal SignatureChanged (or JAX's TypeError) traceback."""
    if framework == "jax":
        jnp = pytest.importorskip("jax.numpy")
        x, other, loss = jnp.ones(3), jnp.ones(4), lambda x: jnp.sum(x**2)
    else:
        x, other, loss = torch.ones(3), torch.ones(4), lambda x: (x**2).sum()
    prepared = ad.prepare(ad.gradient, loss, Active(x))
    with pytest.raises(ad.PreparationMismatchError, match=r"shape \(3,\)") as info:
        prepared(other)
    assert info.value.__context__ is None, repr(info.value.__context__)


def test_the_in_place_hint_does_not_blame_an_active_argument_alone():
    """torch's in-place error does not say which tensor: the note said it was the Active
    argument, which f had not touched, where f wrote a Parameter it reads from outside."""
    outside = torch.nn.Parameter(torch.ones(3))

    def loss(x):
        outside.mul_(2.0)
        return (x * outside).sum()

    x = torch.ones(3)
    with pytest.raises(RuntimeError, match="in-place operation") as info:
        ad.gradient(loss, Active(x))
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert "from outside its arguments" in note, note
    assert torch.equal(outside.detach(), torch.ones(3)) and torch.equal(x, torch.ones(3))


def test_a_call_arriving_during_the_first_call_of_a_torch_problem(monkeypatch):
    """`Problem.call` set its first-call flag before the hook counter that later calls read: a
    second thread's call arriving between the two raised AttributeError on None.next_id. The
    second call is made at that moment, from the counter's look-up, deterministically."""
    import sys

    from activity.backends import _torch_modules

    original, arrived = _torch_modules.hook_handles, []

    def a_second_call_arrives() -> object:
        caller = sys._getframe(1)
        if not arrived and caller.f_code.co_name == "_call_modules":  # (`Problem.call` on modules)
            arrived.append(True)
            caller.f_locals["self"].call(caller.f_locals["f"], caller.f_locals["values"])
        return original()

    monkeypatch.setattr(_torch_modules, "hook_handles", a_second_call_arrives)
    layer, x = torch.nn.Linear(3, 1), torch.ones(2, 3)
    got = ad.gradient(lambda m, x: m(x).sum(), Active(layer), ad.Constant(x))
    assert arrived
    want = torch.autograd.grad(layer(x).sum(), [layer.weight, layer.bias])
    torch.testing.assert_close(got["weight"], want[0])
    torch.testing.assert_close(got["bias"], want[1])


@pytest.mark.parametrize("operator", ["gradient", "hvp"])
def test_second_order_backends_explain_an_in_place_change_too(operator):
    """SecondOrder passed every hook on to its backends but `explain_error`: f changing its
    Active tensor in place got the note with AutoTorch, and none with SecondOrder over it."""
    backend = ad.SecondOrder(ad.AutoTorch(), ad.AutoTorch())

    def loss(x):
        x.mul_(2.0)
        return (x**2).sum()

    x = torch.ones(3)
    seeds = {"tangent": torch.ones(3)} if operator == "hvp" else {}
    with pytest.raises(RuntimeError, match="in-place operation") as info:
        getattr(ad, operator)(loss, Active(x), backend=backend, **seeds)
    assert any("f changes a differentiated tensor in place" in note for note in getattr(info.value, "__notes__", []))
    assert torch.equal(x, torch.ones(3))


@pytest.mark.parametrize("operator", ["gradient", "pullback"])
def test_a_prepared_torch_call_given_a_keyword_named_f(operator):
    """The tape functions took f by name as well: a keyword f= for a prepared call collided
    with it (an internal "got multiple values for argument 'f'") instead of activity's
    message about the unexpected keyword."""
    x = torch.ones(3)
    seeds = {"cotangent": torch.tensor(1.0)} if operator == "pullback" else {}
    prepared = ad.prepare(getattr(ad, operator), lambda x, f=1.0: (x**2).sum() * f, Active(x), **seeds)
    with pytest.raises(TypeError, match=r"activity\.%s got unexpected keyword argument\(s\) \['f'\]" % operator):
        prepared(x, f=2.0, **seeds)

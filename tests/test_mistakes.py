"""A catalogue of user mistakes: one table, one row per mistake.

Each row is ``(id, setup, expected exception type, regexes)``. ``setup()``
builds fresh user objects and returns ``(trigger, objects)``: ``trigger()``
makes the mistake, ``objects`` are everything the user handed to the library.
Each test asserts the exception type, that the message matches every regex
(they name the offending argument, its position and path where there is one,
and say what to do instead), and that every user object is unchanged
afterwards: numpy/JAX arrays bitwise, torch tensors (values, ``.grad``,
``requires_grad``) and modules (``state_dict``, every parameter's ``.grad``
and ``requires_grad``, every submodule's ``training`` flag). A second test
runs the whole catalogue again under ``torch.no_grad()`` and with grad mode
enabled and checks grad mode is left as it was.

The catalogue complements ``test_errors.py``: it covers every backend a
mistake applies to (AutoJAX, AutoTorch, AutoFiniteDifferences) and checks the
user's objects, not only the message.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import activity as ad
from activity import Active, Cache, Constant

J = ad.AutoJAX()
T = ad.AutoTorch()
FD = ad.AutoFiniteDifferences()

WRAPPERS = r"Active\(x\).*Constant\(x\).*Cache\(x\)"


# ============================================================================ user objects


def sq(x: Any) -> Any:
    """sum(x**2) for a numpy, JAX or torch array."""
    return (x**2).sum()


def jx() -> jax.Array:
    return jnp.array([1.0, 2.0, 3.0])


def nx() -> np.ndarray:
    return np.array([1.0, 2.0, 3.0])


def tx(requires_grad: bool = False) -> torch.Tensor:
    t = torch.tensor([1.0, 2.0, 3.0], requires_grad=requires_grad)
    return t


def model() -> torch.nn.Module:
    """A small module in eval mode with a stale .grad and a frozen parameter, so a change shows."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    m.eval()
    m[0].weight.grad = torch.full_like(m[0].weight, 7.0)
    m[1].bias.requires_grad_(False)
    return m


def frozen_model() -> torch.nn.Module:
    m = torch.nn.Linear(3, 2)
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def run_model(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).sum()


# ============================================================================ snapshots


def snapshot(obj: Any) -> Any:
    """A deep, comparable record of ``obj`` (arrays bitwise, torch state in full)."""
    if isinstance(obj, ad.Active | ad.Constant | ad.Cache):
        return ("annotation", type(obj).__name__, snapshot(obj.value))
    if isinstance(obj, torch.nn.Module):
        return (
            "module",
            id(obj),
            {k: snapshot(v) for k, v in obj.state_dict(keep_vars=True).items()},
            [(name, p.requires_grad, None if p.grad is None else snapshot(p.grad)) for name, p in obj.named_parameters()],
            [(name, sub.training) for name, sub in obj.named_modules()],
        )
    if isinstance(obj, torch.Tensor):
        return (
            "tensor",
            id(obj),
            str(obj.dtype),
            tuple(obj.shape),
            obj.detach().cpu().numpy().tobytes(),
            obj.requires_grad,
            None if obj.grad is None else obj.grad.detach().cpu().numpy().tobytes(),
        )
    if isinstance(obj, jax.Array):
        return ("jax", str(obj.dtype), obj.shape, np.asarray(obj).tobytes())
    if isinstance(obj, np.ndarray | np.generic):
        return ("numpy", id(obj), str(obj.dtype), np.shape(obj), np.asarray(obj).tobytes())
    if isinstance(obj, dict):
        return ("dict", id(obj), [(k, snapshot(v)) for k, v in obj.items()])
    if isinstance(obj, list | tuple):
        return (type(obj).__name__, id(obj) if isinstance(obj, list) else None, [snapshot(v) for v in obj])
    return ("other", type(obj).__name__, repr(obj))


# ============================================================================ the catalogue


class Mistake:
    def __init__(self, id: str, setup: Callable[[], tuple[Callable[[], Any], list]], exc: type, patterns: list[str]):
        self.id, self.setup, self.exc, self.patterns = id, setup, exc, patterns


def m(id, exc, patterns):
    """Decorator: register ``setup`` as the mistake ``id``."""

    def register(setup):
        CATALOGUE.append(Mistake(id, setup, exc, patterns))
        return setup

    return register


CATALOGUE: list[Mistake] = []


# ---------------------------------------------------------------- annotations


@m("no-arguments", TypeError, [r"activity\.gradient\(f\) got no arguments for f", r"activity\.gradient\(f, Active\(x\)"])
def _():
    return lambda: ad.gradient(sq), []


@m("no-active-jax", TypeError, [r"no argument is Active", r"Mark the argument\(s\) to differentiate with Active\(x\)"])
def _():
    x, buf = jx(), jx()
    return lambda: ad.gradient(lambda a, b: sq(a), Constant(x), Cache(buf), backend=J), [x, buf]


@m("no-active-torch-module", TypeError, [r"no argument is Active", r"Active\(x\)"])
def _():
    net, x = model(), tx()
    return lambda: ad.gradient(run_model, Constant(net), Constant(x)), [net, x]


@m("unannotated-jax-argument-1", TypeError, [r"argument 1 \(counting from 0 after f\) is unannotated: a jax array\.", WRAPPERS])
def _():
    x, y = jx(), jx()
    return lambda: ad.gradient(lambda a, b: sq(a * b), Active(x), y), [x, y]


@m("unannotated-torch-tensor-argument-0", TypeError, [r"argument 0\b.*unannotated: a torch tensor\.", WRAPPERS])
def _():
    x, y = tx(True), tx()
    return lambda: ad.gradient(lambda a, b: sq(a * b), x, Active(y)), [x, y]


@m("unannotated-torch-module", TypeError, [r"argument 0\b.*unannotated: a torch\.nn\.Sequential\.", WRAPPERS])
def _():
    net, x = model(), tx()
    return lambda: ad.gradient(run_model, net, Constant(x[None])), [net, x]


@m("unannotated-prepare-fd", TypeError, [r"activity\.gradient: argument 1\b.*unannotated: a numpy array\.", WRAPPERS])
def _():
    x, y = nx(), nx()
    return lambda: ad.prepare(ad.gradient, lambda a, b: sq(a * b), Active(x), y, backend=FD), [x, y]


@m("nested-annotation-top-level", TypeError, [r"Active\(Constant\(\.\.\.\)\) nests two annotations", r"Write Constant\(x\) or Active\(x\), not both"])
def _():
    x = jx()
    return lambda: Active(Constant(x)), [x]


@m("nested-annotation-inside-dict-jax", TypeError, [r"argument 0\b.*\(Active\) holds a Constant\(\.\.\.\) at \['w'\]", r"annotations do not nest", r"Annotate each top-level argument once"])
def _():
    p = {"w": Constant(jx()), "b": jx()}
    return lambda: ad.gradient(lambda p: sq(p["w"]) + sq(p["b"]), Active(p), backend=J), [p]


@m("nested-annotation-inside-list-torch", TypeError, [r"argument 1\b.*\(Constant\) holds a Cache\(\.\.\.\) at \[1\]", r"annotations do not nest"])
def _():
    x, data = tx(), [tx(), Cache(tx())]
    return lambda: ad.gradient(lambda a, d: sq(a), Active(x), Constant(data), backend=T), [x, data]


@m("f-not-callable", TypeError, [r"first argument must be the function f; got a numpy array, array\(\[1\., 2\., 3\.\]\)", r"pass f first, then its annotated arguments: activity\.gradient\(f, Active\(x\), \.\.\.\)"])
def _():
    x = nx()
    return lambda: ad.gradient(x, Active(x), backend=FD), [x]


@m("f-not-callable-prepare", TypeError, [r"first argument must be the function f; got a str, 'loss'", r"activity\.hvp\(f, Active\(x\)"])
def _():
    x = jx()
    return lambda: ad.prepare(ad.hvp, "loss", Active(x), tangent=x), [x]


# ---------------------------------------------------------------- Active values


@m("active-python-int-fd", TypeError, [r"argument 0\b.*is Active but holds no floating-point value to differentiate \(a Python int\)", r"Mark it Constant\(\.\.\.\) instead, or write it as a float \(3\.0, or float\(x\)\)"])
def _():
    return lambda: ad.gradient(lambda n: float(n) ** 2, Active(3), backend=FD), []


@m("active-python-bool-jax", TypeError, [r"argument 1\b.*Active but holds no floating-point value to differentiate \(a Python bool\)", r"Constant\(\.\.\.\)"])
def _():
    x = jx()
    return lambda: ad.gradient(lambda a, flag: sq(a), Active(x), Active(True), backend=J), [x]


@m("active-int-tensor-torch", TypeError, [r"argument 0\b.*Active but holds no floating-point value to differentiate \(a torch tensor of dtype torch\.int64\)", r"Constant\(\.\.\.\)", r"convert it with \.float\(\)"])
def _():
    t = torch.arange(3)
    return lambda: ad.gradient(lambda t: t.sum().float(), Active(t)), [t]


@m("active-bool-array-jax", TypeError, [r"argument 0\b.*Active but holds no floating-point value", r"Constant\(\.\.\.\)"])
def _():
    b = jnp.array([True, False])
    return lambda: ad.gradient(lambda b: b.sum() * 1.0, Active(b), backend=J), [b]


@m("active-pytree-without-float-leaf-fd", TypeError, [r"argument 0\b.*Active but holds no floating-point value to differentiate \(a dict\)", r"Constant\(\.\.\.\)"])
def _():
    p = {"n": np.arange(3), "name": "layer", "flags": [True, 2]}
    return lambda: ad.gradient(lambda p: 1.0, Active(p), backend=FD), [p]


@m("active-frozen-torch-module", TypeError, [r"argument 0\b.*is Active\(Linear\), but every parameter of that torch\.nn\.Module has requires_grad=False", r"only parameters with requires_grad=True are differentiated", r"Call model\.requires_grad_\(True\) to differentiate them", r"Constant\(model\)"])
def _():
    net, x = frozen_model(), tx()
    return lambda: ad.gradient(run_model, Active(net), Constant(x)), [net, x]


@m("active-model-parameters-generator-torch", TypeError, [r"argument 0\b.*is Active\(model\.parameters\(\)\), a generator, which can be read only once", r"Pass the module itself, Active\(model\)"])
def _():
    net, x = model(), tx()
    return lambda: ad.gradient(lambda ps, x: sum(p.sum() for p in ps), Active(net.parameters()), Constant(x)), [net, x]


@m("active-string", TypeError, [r"argument 0\b.*Active but holds no floating-point value to differentiate \(a str\)", r"Constant\(\.\.\.\)"])
def _():
    return lambda: ad.gradient(lambda s: 1.0, Active("abc"), backend=FD), []


@m("active-complex-jax", ad.UnsupportedError, [r"argument 0\b.*\(active\) holds a complex value at \['z'\]", r"Split it into real and imaginary parts"])
def _():
    p = {"x": jx(), "z": jnp.ones(2, dtype=jnp.complex64)}
    return lambda: ad.gradient(lambda p: sq(p["x"]), Active(p), backend=J), [p]


@m("active-complex-torch", ad.UnsupportedError, [r"argument 0\b.*complex value at its root", r"real and imaginary"])
def _():
    z = torch.ones(3, dtype=torch.complex64)
    return lambda: ad.gradient(lambda z: z.abs().sum(), Active(z)), [z]


# ---------------------------------------------------------------- Cache values


@m("cache-holding-a-str", TypeError, [r"argument 1\b.*is a Cache holding a str at its root", r"pass other values as Constant\(\.\.\.\)"])
def _():
    x = tx()
    return lambda: ad.gradient(lambda a, s: sq(a), Active(x), Cache("scratch")), [x]


@m("cache-holding-a-python-float-in-dict", TypeError, [r"argument 1\b.*Cache holding a Python float at \['scale'\]", r"A Cache holds arrays", r"Constant\(\.\.\.\)"])
def _():
    x, buf = nx(), {"buf": np.zeros(3), "scale": 2.0}
    return lambda: ad.gradient(lambda a, c: sq(a), Active(x), Cache(buf), backend=FD), [x, buf]


# ---------------------------------------------------------------- f's output


@m("non-scalar-output-gradient-jax", ValueError, [r"activity\.gradient needs f to return a scalar, but it returned an array of shape \(3,\)", r"\.sum\(\) or \.mean\(\)", r"activity\.jacobian"])
def _():
    x = jx()
    return lambda: ad.gradient(lambda a: a**2, Active(x)), [x]


@m("non-scalar-output-hessian-torch", ValueError, [r"activity\.hessian needs f to return a scalar.*shape \(3,\)", r"\.sum\(\)"])
def _():
    x = tx()
    return lambda: ad.hessian(lambda a: a**2, Active(x)), [x]


@m("non-scalar-output-hvp-fd", ValueError, [r"activity\.hvp needs f to return a scalar.*shape \(3,\)", r"\.sum\(\)"])
def _():
    x = nx()
    return lambda: ad.hvp(lambda a: a**2, Active(x), tangent=nx(), backend=FD), [x]


@m("non-scalar-output-pytree-gradient-torch-module", ValueError, [r"needs f to return a scalar, but it returned a tuple of 2 \(a scalar, a scalar\)", r"If the second is auxiliary output .*pass has_aux=True", r"activity\.jacobian"])
def _():
    net, x = model(), tx()
    return lambda: ad.gradient(lambda n, x: (n(x).sum(), n(x).mean()), Active(net), Constant(x[None].repeat(2, 1))), [net, x]


@m("forgotten-has-aux-jax", ValueError, [r"activity\.value_and_gradient needs f to return a scalar, but it returned a tuple of 2 \(a scalar, a dict\)", r"pass has_aux=True"])
def _():
    x = jx()
    return lambda: ad.value_and_gradient(lambda a: (sq(a), {"a": a}), Active(x)), [x]


@m("f-returns-none", TypeError, [r"activity\.gradient: f returned None, which holds no array", r"f must return an array, a float, or a pytree of arrays"])
def _():
    x = jx()
    return lambda: ad.gradient(lambda a: None, Active(x)), [x]


@m("f-returns-a-string", TypeError, [r"f returned a str at its output", r"outputs must be floating-point arrays or floats"])
def _():
    x = tx()
    return lambda: ad.gradient(lambda a: "loss", Active(x)), [x]


@m("f-returns-list-of-ints", TypeError, [r"f returned a Python int at \[0\]", r"outputs must be floating-point"])
def _():
    x = nx()
    return lambda: ad.jacobian(lambda a: [1, 2], Active(x), backend=FD), [x]


@m("f-returns-int-tensor-torch", TypeError, [r"f returned a torch tensor of dtype torch\.int64 at its output", r"floating-point"])
def _():
    x = tx()
    return lambda: ad.jacobian(lambda a: a.long(), Active(x)), [x]


@m("has-aux-but-f-returns-one-value-torch", ValueError, [r"activity\.gradient\(has_aux=True\): f must return a pair \(output, aux\), got a scalar\.", r"drop has_aux=True"])
def _():
    x = tx()
    return lambda: ad.gradient(sq, Active(x), has_aux=True), [x]


@m("has-aux-but-f-returns-one-value-prepared-fd", ValueError, [r"f must return a pair \(output, aux\), got a scalar\.", r"drop has_aux=True"])
def _():
    x = nx()
    prep = ad.prepare(ad.value_and_gradient, sq, Active(x), backend=FD, has_aux=True)
    return lambda: prep(x), [x]


# ---------------------------------------------------------------- scalar-input operators


@m("derivative-of-an-array-jax", ValueError, [r"activity\.derivative differentiates with respect to scalars, but Active argument 0 holds a jax array of shape \(3,\)", r"activity\.jacobian or activity\.pushforward"])
def _():
    x = jx()
    return lambda: ad.derivative(lambda a: a**2, Active(x)), [x]


@m("second-derivative-of-an-array-torch", ValueError, [r"second_derivative differentiates with respect to scalars, but Active argument 0 holds a torch tensor of shape \(3,\)", r"activity\.jacobian"])
def _():
    x = tx()
    return lambda: ad.second_derivative(lambda a: a**3, Active(x)), [x]


@m("derivative-of-a-torch-module", ValueError, [r"Active argument 0 holds a torch\.nn\.Sequential\. Use", r"activity\.jacobian or activity\.pushforward"])
def _():
    net, x = model(), tx()
    return lambda: ad.derivative(run_model, Active(net), Constant(x[None].repeat(2, 1))), [net, x]


# ---------------------------------------------------------------- tangents and cotangents


@m("tangent-wrong-shape-in-dict-jax", ValueError, [r"activity\.pushforward: tangent\['b'\] has shape \(2,\), expected \(3,\)", r"the shape of the Active value there"])
def _():
    p, t = {"a": jx(), "b": jx()}, {"a": jx(), "b": jnp.ones(2)}
    return lambda: ad.pushforward(lambda p: p["a"] * p["b"], Active(p), tangent=t), [p, t]


@m("tangent-int-dtype-torch", ValueError, [r"activity\.pushforward: tangent has dtype torch\.int64", r"tangents are floating point: convert it with \.float\(\)"])
def _():
    x, t = tx(), torch.arange(3)
    return lambda: ad.pushforward(lambda a: a**2, Active(x), tangent=t), [x, t]


@m("tangent-python-int-jax", ValueError, [r"activity\.pushforward: tangent is a Python int; tangents are floating point: write it as a float \(2\.0, or float\(x\)\)"])
def _():
    return lambda: ad.pushforward(lambda a: a**2, Active(1.5), tangent=2, backend=J), []


@m("tangent-is-a-string-fd", ValueError, [r"activity\.hvp: tangent is a str; it must be a float array of shape \(3,\)"])
def _():
    x = nx()
    return lambda: ad.hvp(sq, Active(x), tangent="ones", backend=FD), [x]


@m("tangent-wrong-structure-fd", ValueError, [r"tangent must have the structure of the Active argument 0\b.*: missing \['b'\]\.$"])
def _():
    p, t = {"a": nx(), "b": nx()}, {"a": nx()}
    return lambda: ad.pushforward(lambda p: p["a"] + p["b"], Active(p), tangent=t, backend=FD), [p, t]


@m("tangent-for-two-actives-not-a-tuple-torch", ValueError, [r"with 2 Active arguments, tangent must be a tuple with one entry per Active argument, got a torch tensor"])
def _():
    x, y, t = tx(), tx(), tx()
    return lambda: ad.pushforward(lambda a, b: a * b, Active(x), Active(y), tangent=t), [x, y, t]


@m("tangent-for-module-wrong-keys-torch", ValueError, [r"activity\.hvp: tangent for a module must be a dict keyed like its trainable named_parameters\(\)", r"0\.weight"])
def _():
    net, x = model(), tx()
    t = {"0.weight": torch.ones(2, 3)}
    return lambda: ad.hvp(run_model, Active(net), Constant(x[None].repeat(2, 1)), tangent=t), [net, x, t]


@m("tangent-wrong-shape-in-batch-jax", ValueError, [r"tangents\[1\] has shape \(2,\), expected \(3,\)"])
def _():
    x, ts = jx(), [jx(), jnp.ones(2)]
    return lambda: ad.gradient_and_hvp(sq, Active(x), tangents=ts), [x, ts]


@m("cotangent-wrong-shape-torch", ValueError, [r"activity\.pullback: cotangent has shape \(2,\), but f's output there has shape \(3,\)"])
def _():
    x, c = tx(), torch.ones(2)
    return lambda: ad.pullback(lambda a: a**2, Active(x), cotangent=c), [x, c]


@m("cotangent-int-dtype-in-dict-fd", ValueError, [r"activity\.pullback: cotangent\['v'\]", r"float"])
def _():
    x, c = nx(), {"u": nx(), "v": np.arange(3)}
    return lambda: ad.pullback(lambda a: {"u": a, "v": a * 2}, Active(x), cotangent=c, backend=FD), [x, c]


@m("cotangent-wrong-structure-jax", ValueError, [r"cotangent must have the structure of f's output: missing \['v'\]\.$"])
def _():
    x, c = jx(), {"u": jx()}
    return lambda: ad.pullback(lambda a: {"u": a, "v": a * 2}, Active(x), cotangent=c), [x, c]


@m("both-tangent-and-tangents-torch", TypeError, [r"activity\.pushforward needs exactly one of tangent= \(one vector\) or tangents= \(a list of them\); got both"])
def _():
    x, t = tx(), tx()
    return lambda: ad.pushforward(lambda a: a**2, Active(x), tangent=t, tangents=[t]), [x, t]


@m("neither-cotangent-nor-cotangents-fd", TypeError, [r"activity\.pullback needs exactly one of cotangent= .* or cotangents= .*got neither"])
def _():
    x = nx()
    return lambda: ad.pullback(lambda a: a**2, Active(x), backend=FD), [x]


@m("empty-tangents-fd", ValueError, [r"activity\.hvp: tangents= must be a non-empty list of tangents, got a list of length 0"])
def _():
    x = nx()
    return lambda: ad.hvp(sq, Active(x), tangents=[], backend=FD), [x]


@m("empty-cotangents-torch", ValueError, [r"cotangents= must be a non-empty list of cotangents, got a tuple of length 0"])
def _():
    x = tx()
    return lambda: ad.pullback(lambda a: a**2, Active(x), cotangents=()), [x]


# ---------------------------------------------------------------- backends


@m("torch-and-jax-mixed", TypeError, [r"arguments mix frameworks: torch at argument 1\['t'\] and JAX at argument 0\b", r"Convert them to one framework"])
def _():
    x, d = jx(), {"t": tx()}
    return lambda: ad.gradient(lambda a, d: sq(a), Active(x), Constant(d)), [x, d]


@m("numpy-only-without-backend", TypeError, [r"cannot infer a backend from numpy arrays and Python numbers alone", r"backend=AutoJAX\(\), backend=AutoTorch\(\) or backend=AutoFiniteDifferences\(\)"])
def _():
    x, d = nx(), {"scale": 2.0}
    return lambda: ad.gradient(lambda a, d: sq(a), Active(x), Constant(d)), [x, d]


@m("backend-is-a-string", TypeError, [r"backend must be a backend object such as backend=AutoJAX\(\)", r"got a str 'torch'"])
def _():
    x = tx()
    return lambda: ad.gradient(sq, Active(x), backend="torch"), [x]


@m("backend-is-the-class-not-an-instance", TypeError, [r"backend must be a backend object", r"got the class AutoTorch itself: pass backend=AutoTorch\(\)\."])
def _():
    x = tx()
    return lambda: ad.gradient(sq, Active(x), backend=ad.AutoTorch), [x]


@m("autojax-given-a-torch-module", ad.UnsupportedError, [r"AutoJAX\(\) cannot differentiate the torch value at argument 0\b", r"Use backend=AutoTorch\(\)"])
def _():
    net, x = model(), tx()
    return lambda: ad.gradient(run_model, Active(net), Constant(x[None].repeat(2, 1)), backend=J), [net, x]


@m("autotorch-given-jax-arrays", ad.UnsupportedError, [r"AutoTorch\(\) cannot differentiate the JAX value at argument 0\b", r"Use backend=AutoJAX\(\)"])
def _():
    x = jx()
    return lambda: ad.gradient(sq, Active(x), backend=T), [x]


@m("tangent-for-module-wrong-shape-torch", ValueError, [r"activity\.pushforward: tangent\['0\.bias'\] has shape \(3,\), expected \(2,\)"])
def _():
    net, x = model(), tx()
    t = {"0.weight": torch.ones(2, 3), "0.bias": torch.ones(3), "1.weight": torch.ones(2)}
    return lambda: ad.pushforward(run_model, Active(net), Constant(x[None].repeat(2, 1)), tangent=t), [net, x, t]


@m("ad-over-finite-differences", ad.UnsupportedError, [r"SecondOrder\(outer=AutoTorch\(\), inner=AutoFiniteDifferences\(.*does not support activity\.hessian with an Active argument", r"capabilities\(\)"])
def _():
    x = tx()
    return lambda: ad.hessian(sq, Active(x), backend=ad.SecondOrder(T, FD)), [x]


@m("prepare-with-a-non-operator", TypeError, [r"is not an activity operator", r"Pass one of the operator functions \(e\.g\. activity\.gradient\)"])
def _():
    x = jx()
    return lambda: ad.prepare(jax.grad, sq, Active(x)), [x]


# ---------------------------------------------------------------- prepared objects


def _prepared_torch(*call_args: Any) -> Callable[[], tuple[Callable[[], Any], list]]:
    def setup():
        p = {"w": torch.ones(2, 3), "b": torch.zeros(2)}
        x = tx()
        prep = ad.prepare(ad.gradient, lambda p, x: sq(p["w"] @ x + p["b"]), Active(p), Constant(x))
        args = call_args_for(call_args, p, x)
        return (lambda: prep(*args)), [p, x, *args]

    return setup


def call_args_for(spec: tuple, p: dict, x: torch.Tensor) -> list:
    return [a(p, x) if callable(a) else a for a in spec]


def _register_prepared(id: str, patterns: list[str], *call_args: Any) -> None:
    CATALOGUE.append(Mistake(id, _prepared_torch(*call_args), ad.PreparationMismatchError, [*patterns, r"Prepare again for the new arguments|Pass the same arguments in the same order"]))


_register_prepared(
    "prepared-wrong-kind-torch",
    [r"argument 1\b.*prepared as Constant, called as Active", r"Annotation kinds are fixed by prepare"],
    lambda p, x: p, lambda p, x: Active(x),
)
_register_prepared(
    "prepared-wrong-shape-torch",
    [r"argument 0\b.* at \['b'\]: expected a torch tensor of shape \(2,\) and dtype torch\.float32 on cpu, got a torch tensor of shape \(3,\)"],
    lambda p, x: {"w": p["w"], "b": torch.zeros(3)}, lambda p, x: x,
)
_register_prepared(
    "prepared-wrong-dtype-torch",
    [r"argument 1\b.*expected a torch tensor of shape \(3,\) and dtype torch\.float32 on cpu, got .*dtype torch\.float64"],
    lambda p, x: p, lambda p, x: x.double(),
)
_register_prepared(
    "prepared-wrong-structure-torch",
    [r"argument 0\b.*pytree structure changed: a list of 2 at the root where a dict is expected\."],
    lambda p, x: [p["w"], p["b"]], lambda p, x: x,
)
_register_prepared(
    "prepared-wrong-argument-count-torch",
    [r"prepared with 2 argument\(s\) after f, called with 1"],
    lambda p, x: p,
)
_register_prepared(
    "prepared-wrong-framework-torch",
    [r"argument 1\b.*expected a torch tensor.*got a numpy array"],
    lambda p, x: p, lambda p, x: np.ones(3, np.float32),
)


@m("prepared-wrong-shape-fd", ad.PreparationMismatchError, [r"argument 0\b.* at \[1\]: expected a numpy array of shape \(3,\) and dtype float64, got a numpy array of shape \(4,\)", r"Prepare again"])
def _():
    p, q = [nx(), nx()], [nx(), np.ones(4)]
    prep = ad.prepare(ad.gradient, lambda p: sq(p[0]) + sq(p[1]), Active(p), backend=FD)
    return lambda: prep(q), [p, q]


@m("prepared-wrong-module-torch", ad.PreparationMismatchError, [r"argument 0\b", r"expected a Sequential module", r"got a Linear module", r"Prepare again"])
def _():
    net, other, x = model(), torch.nn.Linear(3, 2), tx()
    prep = ad.prepare(ad.gradient, run_model, Active(net), Constant(x[None].repeat(2, 1)))
    return lambda: prep(other, x[None].repeat(2, 1)), [net, other, x]


@m("prepared-wrong-tangent-shape-jax", ValueError, [r"activity\.pushforward: tangent has shape \(2,\), expected \(3,\)"])
def _():
    x, t, t2 = jx(), jx(), jnp.ones(2)
    prep = ad.prepare(ad.pushforward, lambda a: a**2, Active(x), tangent=t)
    return lambda: prep(x, tangent=t2), [x, t, t2]


@m("prepared-torch-given-a-string", ad.PreparationMismatchError, [r"argument 0\b.*expected a torch tensor of shape \(3,\).*got the value 'abc'", r"Prepare again"])
def _():
    x = tx()
    prep = ad.prepare(ad.gradient, sq, Active(x))
    return lambda: prep("abc"), [x]


@m("prepared-jax-given-a-string-in-dict", ad.PreparationMismatchError, [r"argument 0\b.* at \['a'\]: expected a jax array of shape \(3,\).*got the value 'abc'", r"Prepare again"])
def _():
    p, q = {"a": jx()}, {"a": "abc"}
    prep = ad.prepare(ad.gradient, lambda p: sq(p["a"]), Active(p))
    return lambda: prep(q), [p, q]


def _scaled_in_place(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    x.mul_(scale)  # the mistake: f changes the tensor it differentiates
    return (x**2).sum()


def _bias_bumped(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    m[0].bias.add_(1.0)
    return m(x).sum()


_IN_PLACE = [r"in-place operation", r"f changes a differentiated tensor in place \(the Active argument 0\b", r"x\.clone\(\)", r"Cache\(buffer\)"]

# (Forward mode, which cannot refuse the write, warns of it: tests/test_torch_in_the_wild.py.)
for _op, _seed in (("gradient", {}), ("value_and_gradient", {}), ("pullback", {"cotangent": torch.tensor(1.0)}),
                   ("jacobian", {}), ("hvp", {"tangent": torch.ones(3)})):

    @m(f"torch-{_op}-f-changes-its-active-tensor-in-place", RuntimeError, _IN_PLACE)
    def _(op=getattr(ad, _op), seed=_seed):
        x, scale = tx(), torch.tensor(2.0)
        return lambda: op(_scaled_in_place, Active(x), Constant(scale), backend=T, **seed), [x, scale]

    @m(f"prepared-torch-{_op}-f-changes-its-active-tensor-in-place", RuntimeError, _IN_PLACE)
    def _(op=getattr(ad, _op), seed=_seed):
        x, scale = tx(), torch.tensor(2.0)
        return lambda: ad.prepare(op, _scaled_in_place, Active(x), Constant(scale), **seed)(x, scale, **seed), [x, scale]


@m("torch-f-changes-a-parameter-of-its-active-module-in-place", RuntimeError, _IN_PLACE)
def _():
    net, x = model(), tx()[None].repeat(2, 1)
    prep = ad.prepare(ad.gradient, _bias_bumped, Active(net), Constant(x))
    return lambda: prep(net, x), [net, x]


# ============================================================================ tests


IDS = [mistake.id for mistake in CATALOGUE]


def test_catalogue_is_large_and_ids_are_unique():
    assert len(CATALOGUE) >= 30
    assert len(set(IDS)) == len(IDS)


def _check(mistake: Mistake) -> BaseException:
    trigger, objects = mistake.setup()
    before = [snapshot(obj) for obj in objects]
    with pytest.raises(Exception) as info:
        trigger()
    error = info.value
    assert type(error) is mistake.exc or (isinstance(error, mistake.exc) and mistake.exc is not Exception), (
        f"expected {mistake.exc.__name__}, got {type(error).__name__}: {error}"
    )
    message = "\n".join([str(error), *getattr(error, "__notes__", [])])  # what a traceback shows
    missing = [p for p in mistake.patterns if not re.search(p, message, re.DOTALL)]
    assert not missing, f"message {message!r} does not match {missing}"
    after = [snapshot(obj) for obj in objects]
    for index, (b, a) in enumerate(zip(before, after)):
        assert b == a, f"user object {index} ({type(objects[index]).__name__}) changed"
    return error


@pytest.mark.parametrize("mistake", CATALOGUE, ids=IDS)
def test_mistake(mistake):
    _check(mistake)


@pytest.mark.parametrize("grad_enabled", [True, False], ids=["grad-enabled", "no-grad"])
def test_grad_mode_is_restored_after_every_mistake(grad_enabled):
    failures = []
    for mistake in CATALOGUE:
        with torch.set_grad_enabled(grad_enabled):
            try:
                trigger, _ = mistake.setup()
                trigger()
            except Exception:  # noqa: BLE001 - each mistake raises; only grad mode matters here
                pass
            if torch.is_grad_enabled() is not grad_enabled:
                failures.append(mistake.id)
                torch.set_grad_enabled(grad_enabled)
    assert not failures, f"grad mode changed by {failures}"


@pytest.mark.parametrize("grad_enabled", [True, False], ids=["grad-enabled", "no-grad"])
def test_grad_mode_is_restored_after_an_error_inside_f(grad_enabled):
    """f raises inside the torch transforms (gradient on the tape, hessian in torch.func)."""

    def bad(a):
        raise ZeroDivisionError("user bug")

    x = tx()
    before = snapshot(x)
    with torch.set_grad_enabled(grad_enabled):
        for op, kwargs in [(ad.gradient, {}), (ad.hessian, {}), (ad.pushforward, {"tangent": tx()}),
                           (ad.pullback, {"cotangent": torch.tensor(1.0)}), (ad.hvp, {"tangents": [tx(), tx()]})]:
            with pytest.raises(ZeroDivisionError, match="user bug") as info:
                op(bad, Active(x), **kwargs)
            assert any(f"activity.{op.__name__}" in note for note in getattr(info.value, "__notes__", []))
            assert torch.is_grad_enabled() is grad_enabled, op.__name__
    assert snapshot(x) == before


@pytest.mark.parametrize(
    "backend, make_x, make_t",
    [
        pytest.param(J, jx, tx, id="AutoJAX-torch-tangent"),
        pytest.param(T, tx, nx, id="AutoTorch-numpy-tangent"),
        pytest.param(T, tx, jx, id="AutoTorch-jax-tangent"),
        pytest.param(FD, nx, tx, id="FD-numpy-value-torch-tangent"),
        pytest.param(FD, nx, jx, id="FD-numpy-value-jax-tangent"),
        pytest.param(FD, tx, nx, id="FD-torch-value-numpy-tangent"),
    ],
)
def test_tangent_from_another_framework_is_converted_or_refused_cleanly(backend, make_x, make_t):
    """A tangent in another framework than its value: converted (as AutoJAX and AutoTorch do),
    or a clean error from activity that names the tangent; never a crash inside."""
    x, t = make_x(), make_t()
    before = [snapshot(x), snapshot(t)]
    try:
        result = ad.pushforward(lambda a: a**2, Active(x), tangent=t, backend=backend)
    except (TypeError, ValueError, NotImplementedError) as error:
        assert re.search(r"activity\.pushforward.*tangent", str(error)), f"{type(error).__name__}: {error}"
    else:
        np.testing.assert_allclose(np.asarray(result.detach() if isinstance(result, torch.Tensor) else result), [2.0, 8.0, 18.0], rtol=1e-5)
    assert [snapshot(x), snapshot(t)] == before

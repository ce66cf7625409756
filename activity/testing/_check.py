"""`check`: the one-call derivative check for a layer author, on any framework.

In the spirit of `torch.autograd.gradcheck` and `jax.test_util.check_grads`, but
for functions of several annotated arguments, pytrees and modules, float32
models included. Every derivative is compared with an independent answer:

- the reference's (float64 finite differences by default) along seeded random
  directions: ``pushforward`` along ``u`` against the reference's directional
  derivative, ``pullback`` of ``v`` through ``<pullback(v), u> == <v, J u>``,
  ``gradient`` through ``<gradient, u>``, ``hvp`` along ``u`` against the
  reference's derivative of ``<gradient, u>``, a batch of tangents against the reference's
  one at a time; full ``jacobian`` and ``hessian`` (the reference's derivative of the
  gradient) where the function is small;
- the backend's own other operators: ``hvp`` against ``hessian @ u``, ``gradient_and_hvp`` against both;
- itself: two runs of each operator must agree (nondeterminism).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from .. import _arrays as arrays
from .._annotations import Annotation
from .._errors import RAISED_BY_F
from .._problem import describe_type
from .._tree import flatten, unflatten
from ..backends import resolve_backend
from ..backends._finite_differences import AutoFiniteDifferences
from ._compare import Products, assert_tree_allclose, rounding_atol as _rounding_atol, run_reference, to_float64

_SMALL = 64  # at most this many inputs and outputs: full Jacobians and Hessians are compared too


class CheckReport:
    """What `check` compared; ``str()`` lists each comparison with its status."""

    def __init__(self) -> None:
        self.passed: list[str] = []
        self.failed: list[str] = []
        self.unreliable: list[str] = []

    def __str__(self) -> str:
        lines = [f"  ok    {name}" for name in self.passed]
        lines += [f"  FAIL  {message}" for message in self.failed]
        lines += [f"  ??    {message}" for message in self.unreliable]
        summary = f"{len(self.passed)} checks passed, {len(self.failed)} failed"
        if self.unreliable:
            summary += f", {len(self.unreliable)} not decided (reference unreliable)"
        return "\n".join([summary, *lines])


def check(
    f: Callable[..., Any],
    *args: Annotation[Any],
    backends: Any = None,
    reference: Any = None,
    operators: Sequence[str] | None = None,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    directions: int = 2,
    seed: int = 0,
) -> CheckReport:
    """Check every operator that applies to ``f`` on ``backends`` against ``reference``.

    Args:
        f: the function, called as ``f(*values)``.
        *args: ``f``'s arguments, each annotated `Active`, `Constant` or `Cache`.
        backends: a backend or a list of them; ``None``: the one the arguments' framework implies.
        reference: the independent answer; ``None``: float64 finite differences
            (`AutoFiniteDifferences`).
        operators: only these operators (names such as ``"gradient"``); ``None``: every one
            that applies (the scalar ones only where ``f`` returns a scalar).
        rtol: relative tolerance of each comparison.
        atol: absolute tolerance of each comparison.
        directions: random tangents and cotangents per directional check.
        seed: the seed of those directions.

    Returns:
        A `CheckReport` of every comparison (``passed``, ``failed``, ``unreliable``: those the
        reference could not decide, with its reason).

    Raises:
        AssertionError: some comparison failed; the message names each failing operator,
            backend and path.
        TypeError: an argument is not annotated.

    >>> import torch
    >>> import activity as ad
    >>> from activity.testing import check
    >>> layer = torch.nn.Linear(3, 2)
    >>> report = check(lambda m, x: torch.tanh(m(x)), ad.Active(layer), ad.Constant(torch.randn(4, 3)))
    >>> report.failed
    []
    """
    for position, arg in enumerate(args):
        if not isinstance(arg, Annotation):
            raise TypeError(f"check: argument {position} is unannotated: {describe_type(arg)}; wrap it as Active(...) or Constant(...).")
    values = tuple(a.value for a in args)
    if backends is None:
        backends = [resolve_backend("check", None, values)]
    elif not isinstance(backends, (list, tuple)):
        backends = [backends]
    reference = AutoFiniteDifferences() if reference is None else reference
    import activity as ad

    output = _output(f, args, backends[0])
    scalar = arrays.is_array(output) and arrays.shape(output) == ()
    applicable = ["pushforward", "pullback", "jacobian"] + (["gradient", "hvp", "hessian", "gradient_and_hvp"] if scalar else [])
    chosen = [op for op in applicable if operators is None or op in operators]
    unknown = sorted(set(operators or ()) - set(applicable))
    if unknown:
        raise ValueError(f"check: {unknown} do not apply to this f (they need a scalar output); choose from {applicable}.")
    rng = np.random.default_rng(seed)
    structure = ad.pullback(f, *args, cotangent=_like(output, rng, ones=True), backend=backends[0])
    tangents = [_like(structure, rng) for _ in range(directions)]
    cotangents = [_like(output, rng) for _ in range(directions)]
    small = _total(structure) <= _SMALL and _total(output) <= _SMALL
    report = CheckReport()

    def compare(name: str, actual: Any, expected: Any, reference_used: bool, products: Products = ()) -> None:
        try:
            assert_tree_allclose(actual, expected, rtol=rtol, atol=max(atol, _rounding_atol(actual, expected, products)))
        except AssertionError as error:
            if reference_used and unreliable:
                report.unreliable.append(f"{name}: reference unreliable: {unreliable[0]}")
            elif reference_used and not _finite(expected):
                report.unreliable.append(f"{name}: reference unreliable: {_NOT_FINITE}")
            else:
                report.failed.append(f"{name}: {error}")
        else:
            report.passed.append(name)

    unreliable: list[str] = []

    def reference_call(call: Callable[[], Any]) -> Any:
        """``call()`` of the reference; why it says it cannot decide is kept for `compare`."""
        result, reason = run_reference(call)
        if reason is not None and not unreliable:
            unreliable.append(reason)
        return result

    ref_jvps = [reference_call(lambda t=t: ad.pushforward(f, *args, tangent=t, backend=reference)) for t in tangents]  # type: ignore[misc]
    ref_jac = reference_call(lambda: ad.jacobian(f, *args, backend=reference)) if small and "jacobian" in chosen else None

    for backend in backends:
        label = f"{backend!r}"

        def run(name: str, call: Callable[[], Any]) -> Any:
            try:
                first = call()
                second = call()
            except Exception as error:  # noqa: BLE001 - reported as a failure of this operator
                report.failed.append(f"{name} on {label}: raised {type(error).__name__}: {str(error)[:300]}{_advice(error)}")
                return None
            try:
                assert_tree_allclose(second, first, rtol=1e-6, atol=1e-7)
            except AssertionError as error:
                report.failed.append(f"{name} on {label}: two runs disagree (nondeterministic): {error}")
            return first

        own_gradient: list[Any] = []  # the backend's gradient, for the second-order references

        def of_gradient(call: Callable[[Any], Any], directions: list[int]) -> Any:
            """``call(backend)`` on the reference's derivative of the backend's gradient (one
            difference per input, where the reference's own second differences take minutes),
            if that gradient agrees with the reference along each of ``directions``; else, or
            where the reference cannot differentiate the backend's gradient, on the reference
            alone: a wrong gradient's derivative would agree with a second order wrong the same way."""
            if isinstance(reference, AutoFiniteDifferences):
                if not own_gradient:
                    own_gradient.append(grad if "gradient" in chosen else _gradient_or_none(f, args, backend))
                if all(_agrees(own_gradient[0], tangents[j], ref_jvps[j], rtol, atol) for j in directions):
                    try:
                        return reference_call(lambda: call(ad.SecondOrder(reference, backend)))
                    except Exception:  # noqa: BLE001 - the reference's own derivatives decide instead
                        pass
            return reference_call(lambda: call(reference))

        grad: Any = None
        for i, (u, v) in enumerate(zip(tangents, cotangents)):
            if "pushforward" in chosen:
                jvp = run(f"pushforward[u{i}]", lambda u=u: ad.pushforward(f, *args, tangent=u, backend=backend))  # type: ignore[misc]
                if jvp is not None:
                    compare(f"pushforward[u{i}] on {label} vs reference", jvp, ref_jvps[i], True)
            if "pullback" in chosen:
                vjp = run(f"pullback[v{i}]", lambda v=v: ad.pullback(f, *args, cotangent=v, backend=backend))  # type: ignore[misc]
                if vjp is not None:
                    compare(f"<pullback(v{i}), u{i}> on {label} vs <v{i}, J u{i}> of the reference", _dot(vjp, u), _dot(v, ref_jvps[i]), True, ((vjp, u), (ref_jvps[i], v)))
            if "gradient" in chosen:
                grad = run("gradient", lambda: ad.gradient(f, *args, backend=backend))
                if grad is not None:
                    compare(f"<gradient, u{i}> on {label} vs reference", _dot(grad, u), to_float64(ref_jvps[i]), True, ((grad, u), (ref_jvps[i], None)))
            if "hvp" in chosen:
                hvp = run(f"hvp[u{i}]", lambda u=u: ad.hvp(f, *args, tangent=u, backend=backend))  # type: ignore[misc]
                if hvp is not None:
                    expected = of_gradient(lambda outer, u=u: ad.hvp(f, *args, tangent=u, backend=outer), [i])  # type: ignore[misc]
                    compare(f"hvp[u{i}] on {label} vs the reference's derivative of the gradient", hvp, expected, True)
        if "pushforward" in chosen and len(tangents) > 1:
            batch = run("pushforward(tangents=[...])", lambda: ad.pushforward(f, *args, tangents=tangents, backend=backend))
            if batch is not None:
                # against the reference, not the backend's own single tangents: a batch may be
                # computed another way (AutoTorch's, of a scalar f, from the gradient), and a
                # disagreement between the two would not say which one is wrong
                compare(f"pushforward(tangents=[...]) on {label} vs reference", list(batch), list(ref_jvps), True)
        if ref_jac is not None:
            jac = run("jacobian", lambda: ad.jacobian(f, *args, backend=backend))
            if jac is not None:
                compare(f"jacobian on {label} vs reference", jac, ref_jac, True)
        if small and "hessian" in chosen:
            hess = run("hessian", lambda: ad.hessian(f, *args, backend=backend))
            if hess is not None:
                ref_hess = of_gradient(lambda outer: ad.hessian(f, *args, backend=outer), list(range(len(tangents))))
                compare(f"hessian on {label} vs the reference's derivative of the gradient", hess, ref_hess, True)
        if "gradient_and_hvp" in chosen:
            both = run("gradient_and_hvp", lambda: ad.gradient_and_hvp(f, *args, tangent=tangents[0], backend=backend))
            if both is not None:
                compare(f"gradient_and_hvp on {label} vs gradient and hvp", both, (ad.gradient(f, *args, backend=backend), ad.hvp(f, *args, tangent=tangents[0], backend=backend)), False)
    if report.failed:
        raise AssertionError(f"activity.testing.check: {len(report.failed)} check(s) failed\n{report}")
    return report


_NOT_FINITE = (
    "the reference's derivative is not finite here: f is not differentiable at this point (a domain "
    "edge such as sqrt or log at 0, where a step leaves the domain); move the point inside the domain"
)


def _advice(error: Exception) -> str:
    """The note of activity's that says what to do instead (forward mode through a custom_vjp:
    which operators and backends work; no second order through torch's fused attention), which
    a report line keeps: JAX's and torch's own messages alone do not say it. Not the note naming the call, which the line says already."""
    for note in getattr(error, "__notes__", []):
        if not isinstance(note, str) or note.startswith(RAISED_BY_F):
            continue
        # JAX's notes: "(... activity.hvp ...) advice"; torch's: "activity (AutoTorch): advice"
        if (note.startswith("(") and "activity." in note) or note.startswith("activity ("):
            return f" {note}"
    return ""


def _gradient_or_none(f: Callable[..., Any], args: tuple[Annotation[Any], ...], backend: Any) -> Any:
    import activity as ad

    try:
        return ad.gradient(f, *args, backend=backend)
    except Exception:  # noqa: BLE001 - a gradient that raises is no reference
        return None


def _agrees(gradient: Any, u: Any, ref_jvp: Any, rtol: float, atol: float) -> bool:
    """Whether ``gradient`` (the backend's; None where it raised) agrees along ``u`` with the
    reference's derivative ``ref_jvp`` (the check of ``gradient``, also where it was not chosen)."""
    if gradient is None:
        return False
    actual, expected = _dot(gradient, u), to_float64(ref_jvp)
    products = ((gradient, u), (ref_jvp, None))
    try:  # the tolerances `compare` gives the gradient's own check, so the two never disagree
        assert_tree_allclose(actual, expected, rtol=rtol, atol=max(atol, _rounding_atol(actual, expected, products)))
    except AssertionError:
        return False
    return True


def _finite(tree: Any) -> bool:
    """Whether every floating value of ``tree`` is finite."""
    return all(
        bool(np.isfinite(to_float64(leaf)).all()) for leaf in flatten(tree)[0] if arrays.is_array(leaf) or isinstance(leaf, float)
    )


def _output(f: Callable[..., Any], args: tuple[Annotation[Any], ...], backend: Any) -> Any:
    """``f``'s output at ``args``, evaluated as the operators evaluate ``f``: on the copies they
    give it of what it may change (an NNX module's RNG counts and BatchNorm statistics, torch
    buffers, the global RNGs), never on the user's values. ``f`` rides along as the aux of a
    zero scalar, so any backend's gradient computes it."""
    import activity as ad

    def zero_with_output(*values: Any) -> tuple[Any, Any]:
        output = f(*values)
        floating = [leaf for leaf in flatten(output)[0] if arrays.is_array(leaf) and arrays.dtype_kind(leaf) == "f"]
        if not floating:
            raise TypeError(
                f"check: f returns {describe_type(output)} with no floating array; "
                f"check differentiates functions with floating array outputs."
            )
        # every floating output in the zero, so that it depends on the Active arguments if f does
        return sum(leaf.sum() for leaf in floating) * 0, output

    _, output = ad.gradient(zero_with_output, *args, has_aux=True, backend=backend)
    return output


def _like(tree: Any, rng: np.random.Generator, ones: bool = False) -> Any:
    """Seeded normal values (or ones) with the structure, framework and dtype of ``tree``'s arrays."""
    leaves, spec = flatten(tree)
    out = []
    for leaf in leaves:
        if not arrays.is_array(leaf) or arrays.dtype_kind(leaf) != "f":
            out.append(None if leaf is None else leaf)
            continue
        host = np.ones(arrays.shape(leaf)) if ones else rng.standard_normal(arrays.shape(leaf))
        out.append(_as_like(host, leaf))
    return unflatten(spec, out)


def _as_like(host: np.ndarray, leaf: Any) -> Any:
    converted = arrays.to_framework(host, arrays.framework(leaf))
    if arrays.is_torch(leaf):
        return converted.to(dtype=leaf.dtype, device=leaf.device)
    return converted.astype(leaf.dtype)


def _total(tree: Any) -> int:
    return sum(arrays.size(leaf) for leaf in flatten(tree)[0] if arrays.is_array(leaf))


def _dot(a: Any, b: Any) -> float:
    """The float64 inner product of two trees of the same structure (None leaves skipped)."""
    total = 0.0
    for x, y in zip(flatten(a)[0], flatten(b)[0]):
        if arrays.is_array(x) and arrays.is_array(y):
            total += float(np.sum(to_float64(x) * to_float64(y)))
    return np.float64(total)


__all__ = ["check", "CheckReport"]

"""`assert_tree_allclose`: compare two pytrees leaf by leaf, by path, in float64."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable

import numpy as np

from .. import _arrays as arrays
from .._errors import short_repr
from .._tree import flatten, leaf_paths, structure_difference, unflatten


def to_float64(leaf: Any) -> np.ndarray:
    """A float64 (complex128 for complex values) numpy copy of any array or number."""
    dtype = np.complex128 if arrays.dtype_kind(leaf) == "c" else np.float64
    if arrays.is_torch(leaf):
        leaf = leaf.detach().cpu().resolve_conj().numpy()
    return np.asarray(leaf, dtype=dtype)


def _ignored(path: str, ignore: Any) -> bool:
    if ignore is None:
        return False
    if callable(ignore):
        return bool(ignore(path))
    entries = [ignore] if isinstance(ignore, str) else list(ignore)
    return any(path == entry or path.startswith(entry + ".") or path.startswith(entry + "[") for entry in entries)


def _worst(actual: np.ndarray, expected: np.ndarray, rtol: float, atol: float) -> str:
    # A nan where the other side has a number is an infinite error, never a small one.
    one_nan = np.isnan(actual) != np.isnan(expected)
    with np.errstate(invalid="ignore"):
        error = np.where(one_nan, np.inf, np.abs(actual - expected))
    error = np.where(np.isnan(error), 0.0, error)  # nan against nan in the same place agrees
    excess = error - (atol + rtol * np.abs(np.nan_to_num(expected)))
    index = np.unravel_index(int(np.argmax(excess)), excess.shape) if excess.ndim else ()
    with np.errstate(divide="ignore", invalid="ignore"):
        relative = np.where(error == 0, 0.0, error / np.abs(expected))
    max_abs = float(error.max()) if error.size else 0.0
    max_rel = float(np.where(np.isnan(relative), np.inf, relative).max()) if error.size else 0.0
    where = f" at index {tuple(int(i) for i in index)}" if index else ""
    return (
        f"max abs error {max_abs:.3g}, max rel error {max_rel:.3g}; "
        f"worst{where}: got {', expected '.join(_plain(actual[index], expected[index]))}"
    )


def _plain(got: Any, expected: Any) -> tuple[str, ...]:
    """Two numbers printed plainly (``4.04``, not ``np.float64(4.039999999999967)``), with just
    enough significant digits to tell them apart."""
    pair = [complex(v) if np.iscomplexobj(v) else float(v) for v in (got, expected)]
    for digits in (6, 9, 12, 17):
        shown = tuple(f"{v:.{digits}g}" for v in pair)
        if shown[0] != shown[1]:
            return shown
    return shown


def assert_tree_allclose(
    actual: Any,
    expected: Any,
    *,
    rtol: float,
    atol: float,
    ignore: str | Iterable[str] | Callable[[str], bool] | None = None,
) -> int:
    """Assert two pytrees have the same structure and close floating leaves.

    Every floating leaf is compared in float64 as ``|a - e| <= atol + rtol * |e|``
    (NaN equals NaN in the same place); other leaves must be equal; ``None``
    against ``None`` is skipped.

    Args:
        actual: the tree to check (numpy, JAX or torch leaves, any pytree or module gradient).
        expected: the tree it must match.
        rtol: relative tolerance.
        atol: absolute tolerance.
        ignore: paths not compared: a path string, several (each also a prefix of the
            paths below it), or a predicate on a path.

    Returns:
        The number of leaves compared.

    Raises:
        AssertionError: the structures differ, some leaves are not close (the message lists
            every mismatching path with its max absolute and relative error and worst
            index), or no leaf was compared at all (a check that checks nothing must not pass).

    >>> import numpy as np
    >>> from activity.testing import assert_tree_allclose
    >>> assert_tree_allclose({"w": np.ones(2)}, {"w": np.ones(2) + 1e-9}, rtol=1e-6, atol=0)
    1
    """
    actual_leaves, actual_spec = flatten(actual)
    expected_leaves, expected_spec = flatten(expected)
    if actual_spec != expected_spec:
        raise AssertionError(
            f"pytree structures differ: {structure_difference(expected, actual)} (in actual, against expected)"
        )
    paths = leaf_paths(expected) if expected_leaves else []
    failures, compared = [], 0
    for path, a, e in zip(paths, actual_leaves, expected_leaves):
        label = path or "(root)"
        if _ignored(path, ignore):
            continue
        numeric = (arrays.is_array(a) or isinstance(a, (int, float))) and (
            arrays.is_array(e) or isinstance(e, (int, float))
        )
        kinds = {arrays.dtype_kind(a), arrays.dtype_kind(e)} if numeric else set()
        if not numeric or not kinds & {"f", "c"}:
            if numeric:
                equal = np.array_equal(to_float64(a), to_float64(e))
            else:
                equal = a is e or _safe_equal(a, e)
            if not equal:
                failures.append(f"  {label}: {short_repr(a, 80)} != {short_repr(e, 80)}")
            compared += 1
            continue
        a64, e64 = to_float64(a), to_float64(e)
        compared += 1
        if a64.shape != e64.shape:
            failures.append(f"  {label}: shape {a64.shape} != expected shape {e64.shape}")
            continue
        close = np.isclose(a64, e64, rtol=rtol, atol=atol, equal_nan=True)
        if not close.all():
            failures.append(f"  {label}: {int((~close).sum())} of {close.size} entries differ; {_worst(a64, e64, rtol, atol)}")
    if failures:
        raise AssertionError(f"{len(failures)} of {compared} leaves differ (rtol={rtol}, atol={atol}):\n" + "\n".join(failures))
    if compared == 0:
        raise AssertionError(
            "assert_tree_allclose compared no leaf at all (empty trees, or everything ignored); "
            "a comparison that checks nothing does not pass."
        )
    return compared


def _safe_equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - == that is not a bool means "not comparable": unequal
        return False


def run_reference(call: Callable[[], Any]) -> tuple[Any, str | None]:
    """``call()`` of a reference, and why it says it cannot decide (the ``reason`` of the first
    `ReferenceUnreliableWarning` it raised), or None; its other warnings reach the user."""
    from ..backends._finite_differences import ReferenceUnreliableWarning

    reason = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ReferenceUnreliableWarning)
        result = call()
    for warning in caught:
        if issubclass(warning.category, ReferenceUnreliableWarning):
            reason = reason or warning.category.reason
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return result, reason


Products = tuple[tuple[Any, Any], ...]  # (tree, direction): an inner product a compared value was reduced from


def rounding_atol(actual: Any, expected: Any, products: Products = ()) -> float:
    """The error that rounding alone leaves in an entry of ``actual`` where it is computed below
    float64: a few rounding units of the largest entry of ``expected``. An entry that is a
    cancellation of terms of that size (an attention key bias's second derivative, exactly 0)
    keeps noise of their size, far above ``atol`` in a float32 model whose Hessian is of size 60.

    A value reduced to a float64 inner product (``<gradient, u>``) no longer shows the dtype it
    was computed in: ``products`` names each ``(tree, direction)`` it came from (direction None:
    the tree is the value itself). A bfloat16 gradient was held to float64's rounding, and failed,
    where the same model's pushforward, compared in its own dtype, passed. Its entries' rounding
    errors add up in the product like independent ones: a few rounding units of the root sum of
    squares of the terms (measured: at most 1.6 units for right bfloat16 and float16 gradients,
    at least 3 for one 50% off, in most directions far more), not 16 of their sum, which would
    pass a gradient 50% off."""
    from ..backends._finite_differences import _coarsest_rounding, _low_precision

    if products:
        floating = tuple(leaf for tree, _ in products for leaf in flatten(tree)[0] if arrays.is_array(leaf) and arrays.dtype_kind(leaf) == "f")
        eps = _coarsest_rounding(_low_precision(floating))
        terms = [_inner(_squares(tree), _squares(direction)) if direction is not None else _entry_sum(_squares(tree)) for tree, direction in products]
        return 4 * eps * max((float(np.sqrt(t)) for t in terms if np.isfinite(t)), default=0.0)
    eps = _coarsest_rounding(_low_precision(tuple(leaf for leaf in flatten(actual)[0] if arrays.is_array(leaf) and arrays.dtype_kind(leaf) == "f")))
    if not eps:
        return 0.0
    # floating leaves only: an aux may hold a PRNG key, which has no float64 value
    magnitudes = [np.abs(to_float64(leaf)) for leaf in flatten(expected)[0] if (arrays.is_array(leaf) and arrays.dtype_kind(leaf) in "fc") or isinstance(leaf, float)]
    scale = max((float(np.max(m[np.isfinite(m)], initial=0.0)) for m in magnitudes), default=0.0)
    return 16 * eps * scale


def _squares(tree: Any) -> Any:
    """``tree`` with each array leaf replaced by its float64 square."""
    leaves, spec = flatten(tree)
    return unflatten(spec, [np.square(to_float64(leaf)) if arrays.is_array(leaf) else leaf for leaf in leaves])


def _inner(a: Any, b: Any) -> float:
    """The float64 inner product of two trees of the same structure (None leaves skipped)."""
    return float(sum(float(np.sum(to_float64(x) * to_float64(y))) for x, y in zip(flatten(a)[0], flatten(b)[0]) if arrays.is_array(x) and arrays.is_array(y)))


def _entry_sum(a: Any) -> float:
    """The float64 sum of every entry of the arrays of ``a``."""
    return float(sum(float(np.sum(to_float64(x))) for x in flatten(a)[0] if arrays.is_array(x)))

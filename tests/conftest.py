"""Generic helpers shared by the test modules, exposed as fixtures.

- ``assert_tree_close(actual, expected, *, rtol, atol, framework=None, dtype=None)``:
  recursive comparison of two results (dicts, lists, tuples, namedtuples,
  dataclasses, attrs instances, Equinox modules, ``None``, arrays, scalars).
  Container types, keys and lengths must match exactly; ``None`` must meet
  ``None``; array leaves must have the same shape and be close in float64.
  ``framework`` ("numpy" or "jax") and ``dtype`` check every array leaf of
  ``actual``. It fails when not a single floating leaf was compared.
- ``intact(*trees)``: a context manager that snapshots every array (a numpy
  copy) and container of ``trees`` on entry and asserts on exit that all of
  them are bitwise unchanged.

These are fixtures (rather than imports from ``conftest``) so the modules do
not depend on how pytest puts ``tests/`` on ``sys.path``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from typing import Any

import attrs
import numpy as np
import pytest

# XLA's CPU backend optimises every program it compiles with LLVM's -O2 passes, and emits fused
# loops through its MLIR fusion emitters. The suite compiles a few thousand tiny programs (and JAX
# compiles each primitive of an eager call), most of them run a handful of times: there compiling
# is most of the suite's JAX time, and the optimisation saves nothing at run time. Without the
# passes and with the older, simpler emitters a small program compiles in about half the time
# (measured: tests/test_check.py and test_wild_sweep_jax.py, 66 s of CPU before, 40 s after).
# Set here, before JAX starts its backend, it also reaches the docs' and examples' subprocesses; a
# caller's own XLA_FLAGS are kept.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _is_jax(x: Any) -> bool:
    import sys

    if "jax" not in sys.modules:
        return False
    return isinstance(x, sys.modules["jax"].Array)


def _is_torch(x: Any) -> bool:
    import sys

    if "torch" not in sys.modules:
        return False
    return isinstance(x, sys.modules["torch"].Tensor)


def _is_array(x: Any) -> bool:
    return isinstance(x, (np.ndarray, np.generic)) or _is_jax(x) or _is_torch(x)


def _to_numpy(x: Any) -> np.ndarray:
    if _is_torch(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _fields(x: Any) -> list[tuple[str, Any]] | None:
    """Named children of a dataclass / attrs instance (Equinox modules are dataclasses)."""
    if isinstance(x, type):
        return None
    if attrs.has(type(x)):
        return [(a.name, getattr(x, a.name)) for a in attrs.fields(type(x))]
    if dataclasses.is_dataclass(x):
        return [(f.name, getattr(x, f.name)) for f in dataclasses.fields(x)]
    return None


class _Comparison:
    def __init__(self, rtol: float, atol: float, framework: str | None, dtype: Any):
        self.rtol, self.atol, self.framework, self.dtype = rtol, atol, framework, dtype
        self.errors: list[str] = []
        self.compared = 0

    def fail(self, path: str, message: str) -> None:
        self.errors.append(f"{path or '<root>'}: {message}")

    def leaf(self, path: str, actual: Any, expected: Any) -> None:
        if _is_array(expected) or isinstance(expected, float):
            expected_arr = _to_numpy(expected)
            if expected_arr.dtype.kind not in "fiu":
                self.fail(path, f"expected leaf of dtype {expected_arr.dtype} is not numeric")
                return
            if not (_is_array(actual) or isinstance(actual, float)):
                self.fail(path, f"expected an array, got {type(actual).__name__} {actual!r:.80}")
                return
            if self.framework is not None:
                ok = {
                    "numpy": isinstance(actual, (np.ndarray, np.generic)),
                    "jax": _is_jax(actual),
                    "torch": _is_torch(actual),
                }[self.framework]
                if not ok:
                    self.fail(path, f"expected a {self.framework} array, got {type(actual).__module__}.{type(actual).__name__}")
                    return
            got_dtype = getattr(actual, "dtype", type(actual).__name__)
            if self.dtype is not None and str(got_dtype) != str(np.dtype(self.dtype)):
                self.fail(path, f"expected dtype {np.dtype(self.dtype)}, got {got_dtype}")
                return
            actual_arr = _to_numpy(actual)
            if actual_arr.shape != expected_arr.shape:
                self.fail(path, f"shape {actual_arr.shape} != expected {expected_arr.shape}")
                return
            if actual_arr.dtype.kind != "f" and expected_arr.dtype.kind == "f":
                self.fail(path, f"expected a floating array, got dtype {actual_arr.dtype}")
                return
            a = actual_arr.astype(np.float64)
            e = expected_arr.astype(np.float64)
            bad = ~(np.abs(a - e) <= self.atol + self.rtol * np.abs(e))
            if bad.any():
                abs_err = float(np.max(np.abs(a - e)))
                rel_err = float(np.max(np.abs(a - e) / np.maximum(np.abs(e), 1e-300)))
                self.fail(
                    path,
                    f"values differ at {int(bad.sum())} of {bad.size} entries: max abs error {abs_err:.3g}, "
                    f"max rel error {rel_err:.3g} (rtol={self.rtol}, atol={self.atol})\n"
                    f"      actual:   {np.array2string(a.ravel()[:8], precision=12)}\n"
                    f"      expected: {np.array2string(e.ravel()[:8], precision=12)}",
                )
            if expected_arr.dtype.kind == "f":
                self.compared += 1
            return
        # Non-numeric leaves (strings, callables, bools, ...): equality.
        try:
            same = actual is expected or bool(actual == expected)
        except Exception:  # noqa: BLE001
            same = False
        if not same or type(actual) is not type(expected):
            self.fail(path, f"expected {expected!r:.80}, got {actual!r:.80}")

    def walk(self, path: str, actual: Any, expected: Any) -> None:
        if expected is None:
            if actual is not None:
                self.fail(path, f"expected None, got {type(actual).__name__} {actual!r:.80}")
            return
        if actual is None:
            self.fail(path, f"got None, expected {type(expected).__name__} {expected!r:.80}")
            return
        if isinstance(expected, dict):
            if type(actual) is not type(expected):
                self.fail(path, f"expected a {type(expected).__name__}, got {type(actual).__name__}")
                return
            if set(actual) != set(expected):
                self.fail(path, f"keys {sorted(map(str, actual))} != expected {sorted(map(str, expected))}")
                return
            for key in expected:
                self.walk(f"{path}[{key!r}]", actual[key], expected[key])
            return
        if isinstance(expected, (list, tuple)):
            if type(actual) is not type(expected):
                self.fail(path, f"expected a {type(expected).__name__}, got {type(actual).__name__}")
                return
            if len(actual) != len(expected):
                self.fail(path, f"length {len(actual)} != expected {len(expected)}")
                return
            names = expected._fields if _is_namedtuple(expected) else None
            for i, (a, e) in enumerate(zip(actual, expected)):
                self.walk(f"{path}.{names[i]}" if names else f"{path}[{i}]", a, e)
            return
        fields = _fields(expected)
        if fields is not None:
            if type(actual) is not type(expected):
                self.fail(path, f"expected a {type(expected).__name__}, got {type(actual).__name__}")
                return
            for name, e in fields:
                self.walk(f"{path}.{name}", getattr(actual, name), e)
            return
        self.leaf(path, actual, expected)


def assert_tree_close(
    actual: Any,
    expected: Any,
    *,
    rtol: float,
    atol: float,
    framework: str | None = None,
    dtype: Any = None,
) -> None:
    comparison = _Comparison(rtol, atol, framework, dtype)
    comparison.walk("", actual, expected)
    if comparison.errors:
        raise AssertionError("results differ:\n  " + "\n  ".join(comparison.errors))
    if comparison.compared == 0:
        raise AssertionError("assert_tree_close compared no floating-point leaf: a check that checks nothing")


# --------------------------------------------------------------------------- snapshots


@dataclasses.dataclass(frozen=True)
class _Arr:
    kind: str
    dtype: str
    shape: tuple
    data: bytes


def snapshot(tree: Any) -> tuple:
    """A deep, bitwise snapshot of ``tree``: containers rebuilt, arrays as bytes."""
    if _is_array(tree):
        arr = _to_numpy(tree)
        kind = "jax" if _is_jax(tree) else "torch" if _is_torch(tree) else "numpy"
        return ("array", _Arr(kind, str(arr.dtype), arr.shape, np.ascontiguousarray(arr).tobytes()))
    if isinstance(tree, dict):
        return ("dict", type(tree), {k: snapshot(v) for k, v in tree.items()})
    if isinstance(tree, (list, tuple)):
        return ("seq", type(tree), [snapshot(v) for v in tree])
    fields = _fields(tree)
    if fields is not None:
        return ("fields", type(tree), [(name, snapshot(v)) for name, v in fields])
    return ("leaf", type(tree), tree)


def _same_leaf(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return False


def _diff(path: str, before: tuple, after: tuple, out: list[str]) -> None:
    where = path or "<root>"
    if before[0] != after[0] or (before[0] != "array" and before[1] is not after[1]):
        out.append(f"{where}: changed from a {before[0]} node to a {after[0]} node, or its type changed")
        return
    tag = before[0]
    if tag == "array":
        if before[1] != after[1]:
            b, a = before[1], after[1]
            what = "contents" if (b.kind, b.dtype, b.shape) == (a.kind, a.dtype, a.shape) else "kind/dtype/shape"
            out.append(f"{where}: array {what} changed ({b.kind} {b.dtype} {b.shape} -> {a.kind} {a.dtype} {a.shape})")
    elif tag == "leaf":
        if not _same_leaf(before[2], after[2]):
            out.append(f"{where}: {before[2]!r:.60} became {after[2]!r:.60}")
    elif tag == "dict":
        b, a = before[2], after[2]
        if list(b) != list(a):
            out.append(f"{where}: keys changed from {list(b)} to {list(a)}")
            return
        for k in b:
            _diff(f"{path}[{k!r}]", b[k], a[k], out)
    elif tag == "seq":
        b, a = before[2], after[2]
        if len(b) != len(a):
            out.append(f"{where}: length changed from {len(b)} to {len(a)}")
            return
        for i, (x, y) in enumerate(zip(b, a)):
            _diff(f"{path}[{i}]", x, y, out)
    else:  # fields
        for (name, x), (_, y) in zip(before[2], after[2]):
            _diff(f"{path}.{name}", x, y, out)


def assert_unchanged(tree: Any, before: Any) -> None:
    problems: list[str] = []
    _diff("", before, snapshot(tree), problems)
    if problems:
        raise AssertionError("argument was modified:\n  " + "\n  ".join(problems))


@contextlib.contextmanager
def intact(*trees: Any):
    """Assert that every array and container in ``trees`` is bitwise unchanged by the block."""
    before = [snapshot(t) for t in trees]
    yield
    for position, (tree, snap) in enumerate(zip(trees, before)):
        try:
            assert_unchanged(tree, snap)
        except AssertionError as error:
            raise AssertionError(f"tree {position} given to intact(): {error}") from None


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(name="assert_tree_close")
def _assert_tree_close_fixture():
    return assert_tree_close


@pytest.fixture(name="intact")
def _intact_fixture():
    return intact


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny tensors: one thread avoids oversubscription on a 2-core machine (restored afterwards)."""
    try:
        import torch
    except ImportError:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

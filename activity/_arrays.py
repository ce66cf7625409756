"""The few array operations the generic layer needs, for numpy, JAX and torch arrays.

Every function dispatches on the type of its array argument, so generic code
(operators, finite differences, Jacobian layout) is written once.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np


# A framework that is not imported yet cannot have made ``x``: these never import one.
def is_torch(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def is_torch_module(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.nn.Module)


def is_jax(x: Any) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and hasattr(jax, "Array") and isinstance(x, jax.Array)


def is_array(x: Any) -> bool:
    return isinstance(x, (np.ndarray, np.generic)) or is_jax(x) or is_torch(x)


def framework(x: Any) -> str | None:
    """``"numpy"``, ``"jax"``, ``"torch"``, or None for anything that is not an array."""
    if isinstance(x, (np.ndarray, np.generic)):
        return "numpy"
    if is_jax(x):
        return "jax"
    if is_torch(x) or is_torch_module(x):
        return "torch"
    return None


def dtype_kind(x: Any) -> str:
    """``"f"`` floating, ``"c"`` complex, ``"i"`` integer, ``"b"`` bool, ``"?"`` other."""
    if isinstance(x, bool):
        return "b"
    if isinstance(x, int):
        return "i"
    if isinstance(x, float):
        return "f"
    if isinstance(x, complex):
        return "c"
    if is_torch(x):
        if x.dtype.is_floating_point:
            return "f"
        if x.dtype.is_complex:
            return "c"
        return "b" if x.dtype == sys.modules["torch"].bool else "i"
    if not is_array(x):  # a module or any other object with a ``dtype`` attribute is not an array
        return "?"
    try:
        kind = np.dtype(x.dtype).kind
    except TypeError:  # extended dtypes such as JAX's typed PRNG keys: data, never floating
        return "?"
    if kind == "V" and _is_ml_float(x.dtype):  # bfloat16, float8_*: numpy calls them void
        return "f"
    return {"u": "i"}.get(kind, kind) if kind in "fciub" else "?"


def is_floating_dtype(dtype: Any) -> bool:
    """Whether a dtype (or its numpy name) is floating, ml_dtypes' bfloat16 and float8 types included."""
    try:
        kind = np.dtype(dtype).kind
    except TypeError:
        return False
    return kind == "f" or (kind == "V" and _is_ml_float(dtype))


def _is_ml_float(dtype: Any) -> bool:
    ml_dtypes = sys.modules.get("ml_dtypes")  # imported by JAX; an array of these types implies it
    if ml_dtypes is None:
        return False
    try:
        ml_dtypes.finfo(dtype)
    except (TypeError, ValueError):
        return False
    return True


def shape(x: Any) -> tuple[int, ...]:
    return tuple(np.shape(x)) if not is_torch(x) else tuple(x.shape)


def size(x: Any) -> int:
    return math.prod(shape(x))


def namespace(x: Any) -> Any:
    """The array module of ``x``: numpy, jax.numpy or torch."""
    if is_torch(x):
        return sys.modules["torch"]
    if is_jax(x):
        import jax.numpy as jnp

        return jnp
    return np


def reshape(x: Any, new_shape: tuple[int, ...]) -> Any:
    return x.reshape(new_shape) if hasattr(x, "reshape") else np.reshape(x, new_shape)


def stack(xs: list[Any], axis: int = 0) -> Any:
    xp = namespace(xs[0])
    return xp.stack(list(xs), axis) if xp is not sys.modules.get("torch") else xp.stack(list(xs), dim=axis)  # type: ignore[union-attr]


def moveaxes_front_to_back(x: Any, n_front: int) -> Any:
    """Move the first ``n_front`` axes of ``x`` to the end, keeping their order."""
    ndim = len(shape(x))
    order = tuple(range(n_front, ndim)) + tuple(range(n_front))
    return x.permute(order) if is_torch(x) else namespace(x).transpose(x, order)


def basis(total: int, like: Any) -> Any:
    """Identity matrix of size ``total`` with the dtype and device of ``like``."""
    if is_torch(like):
        return sys.modules["torch"].eye(total, dtype=like.dtype, device=like.device)
    return namespace(like).eye(total, dtype=like.dtype)


def split_columns(matrix: Any, sizes: list[int]) -> list[Any]:
    """Split the last axis of ``matrix`` into consecutive blocks of ``sizes``."""
    out, start = [], 0
    for n in sizes:
        out.append(matrix[..., start : start + n])
        start += n
    return out


def concat_flat(xs: list[Any]) -> Any:
    """Concatenate the flattened leaves ``xs`` (batched over a leading axis) into one matrix."""
    xp = namespace(xs[0])
    parts = [reshape(x, (shape(x)[0], math.prod(shape(x)[1:]))) for x in xs]  # -1 is ambiguous when empty
    return xp.cat(parts, dim=1) if xp is sys.modules.get("torch") else xp.concatenate(parts, axis=1)  # type: ignore[union-attr]


def zeros(new_shape: tuple[int, ...], like: Any) -> Any:
    """Zeros of ``new_shape`` with the framework, dtype (and device) of ``like``."""
    if is_torch(like):
        return like.new_zeros(new_shape)
    return namespace(like).zeros(new_shape, dtype=like.dtype)


def ones_like(x: Any) -> Any:
    return namespace(x).ones_like(x)


def zeros_like(x: Any) -> Any:
    return namespace(x).zeros_like(x)


def to_framework(x: Any, name: str | None) -> Any:
    """``x`` as an array of framework ``name`` (through numpy when it comes from another one)."""
    have = framework(x)
    if have is None or name is None or have == name:
        return x
    host = x.detach().cpu().numpy() if is_torch(x) else np.asarray(x)
    if name == "torch":
        return sys.modules["torch"].as_tensor(host)
    if name == "jax":
        return sys.modules["jax"].numpy.asarray(host)
    return host


# Placeholders stand in for arrays when preparing: they have a shape and a dtype, no data.
def is_jax_placeholder(x: Any) -> bool:
    """A ``jax.ShapeDtypeStruct``."""
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.ShapeDtypeStruct)


def is_torch_placeholder(x: Any) -> bool:
    """A torch tensor on the ``meta`` device."""
    return is_torch(x) and x.is_meta


def is_placeholder(x: Any) -> bool:
    return is_jax_placeholder(x) or is_torch_placeholder(x)


# Layouts the operators and the backends share (a backend never imports the operator layer).


def input_basis(xs: tuple[Any, ...], backend: Any) -> tuple[Any, ...]:
    """One tangent per scalar entry of ``xs``: a batch of ``sum(sizes)`` unit vectors."""
    sizes = [size(x) for x in xs]
    eye = basis(sum(sizes), xs[0])
    blocks = split_columns(eye, sizes)
    return tuple(
        backend.as_tangent(reshape(block, (sum(sizes), *shape(x))), x.dtype)
        for block, x in zip(blocks, xs)
    )


def output_basis(ys: tuple[Any, ...]) -> tuple[Any, ...]:
    sizes = [size(y) for y in ys]
    eye = basis(sum(sizes), ys[0])
    return tuple(
        reshape(block, (sum(sizes), *shape(y)))
        for block, y in zip(split_columns(eye, sizes), ys)
    )

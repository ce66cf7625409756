"""torch internals activity relies on, each behind a public-API fallback that a test forces.

- `lazy_clone`: torch's copy-on-write clone (``torch._lazy_clone``), a copy that shares its
  original's memory until one of the two is written. Where this torch has none (before 2.3),
  or a tensor it does not take (sparse layouts), a plain ``clone()``: the same values and the
  same independence, paid for in memory on every call.
"""

from __future__ import annotations

import sys
from typing import Any


def lazy_clone(tensor: Any) -> Any:
    """A copy of ``tensor`` that costs no memory until it or ``tensor`` is written: then only
    the side written gets memory of its own, so neither ever sees the other's writes."""
    torch = sys.modules["torch"]
    clone = getattr(torch, "_lazy_clone", None)
    if clone is not None:
        try:
            return clone(tensor)
        except (RuntimeError, NotImplementedError, TypeError):  # a layout without storage (sparse)
            pass
    return tensor.clone()


__all__ = ["lazy_clone"]

"""PyTorch (placeholder until the PyTorch issue lands)."""

from __future__ import annotations

import attrs

from ._base import Backend


@attrs.frozen
class AutoTorch(Backend):
    framework = "torch"

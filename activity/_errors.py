"""Exceptions of the public API."""

from __future__ import annotations


class UnsupportedError(NotImplementedError):
    """A backend does not support an operator, annotation kind or input type."""


class PreparationMismatchError(ValueError):
    """A prepared operator was called with arguments unlike those it was prepared for."""


def add_note(error: BaseException, note: str) -> None:
    """Attach ``note`` to ``error`` (PEP 678) without changing its type or traceback."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:  # Python 3.10
        error.__notes__ = [*getattr(error, "__notes__", []), note]  # type: ignore[attr-defined, unused-ignore]

"""Exceptions of the public API."""

from __future__ import annotations

import sys
import types


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


RAISED_BY_F = "(raised by f inside activity."
"""How the note on an exception raised by the user's ``f`` begins (see `Problem.call`)."""

_JAX_FRAMES_NOTE = "JAX has removed its internal frames"


def drop_jax_note(error: BaseException) -> None:
    """Take off one of activity's own errors what JAX attached to it on its way out of a JAX
    transform: the note that JAX removed its internal frames (or, with
    ``JAX_TRACEBACK_FILTERING=remove_frames``, the cause carrying the unfiltered traceback).
    activity checks f's output while JAX traces f, but the mistake is in the user's call, not
    inside JAX. An exception raised by f itself keeps what JAX says about it."""
    notes = getattr(error, "__notes__", None)
    if notes and any(isinstance(note, str) and note.startswith(RAISED_BY_F) for note in notes):
        return
    if notes:
        kept = [note for note in notes if not (isinstance(note, str) and _JAX_FRAMES_NOTE in note)]
        if kept:
            error.__notes__ = kept
        else:
            del error.__notes__
    cause = error.__cause__
    if cause is not None and type(cause).__name__ == "UnfilteredStackTrace" and type(cause).__module__.startswith("jax"):
        error.__cause__, error.__context__ = cause.__cause__, cause.__context__
        error.__suppress_context__ = cause.__suppress_context__


_EQUINOX_JIT_ADVICE = "Please wrap your program with `equinox.filter_jit`"


def explain_runtime_check(error: BaseException, call: str) -> None:
    """Say, on a runtime check inside f that failed in a prepared call (``equinox.error_if``:
    lineax's singular operator, optimistix's divergence), that the message is f's and that
    Equinox's advice to wrap the program with ``equinox.filter_jit`` does not apply: activity
    compiled the call with ``jax.jit``, where Equinox cannot say more. ``call`` names the
    prepared call (``"gradient with backend AutoJAX()"``)."""
    if _EQUINOX_JIT_ADVICE not in str(error) or any(str(n).startswith(RAISED_BY_F) for n in getattr(error, "__notes__", [])):
        return
    add_note(
        error,
        f"{RAISED_BY_F}{call}, prepared) A runtime check inside f failed (equinox.error_if, as lineax "
        f"and optimistix use): its message is above. Equinox's advice to wrap the program with "
        f"equinox.filter_jit does not apply: activity compiled this call itself; the unprepared "
        f"operator, called on the same values, raises the check with Equinox's own stack.",
    )


# Frames a warning walks past to reach the user's call: activity's own, and those of the
# frameworks that run f (a warning may be raised while JAX traces, or inside torch's dispatch).
_LIBRARY_FRAMES = ("activity", "jax", "jaxlib", "torch")


def caller_stacklevel() -> int:
    """The ``stacklevel`` for `warnings.warn` that points at the caller's code: the first
    frame outside activity and the frameworks that run f."""
    frame: types.FrameType | None
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in _LIBRARY_FRAMES:
        frame, level = frame.f_back, level + 1
    return level


_CLOSERS = {"(": ")", "[": "]", "{": "}"}


def short_repr(value: object, limit: int = 60) -> str:
    """``repr(value)`` for a message, on one line and at most about ``limit`` characters: cut on
    a token boundary (after a comma, a space or an opening bracket, never inside a number or a
    name), marked ``...``, the brackets left open closed again, so
    ``Active({'w': Array([[1., 1., ...]])})`` still reads as what it is. A function is named
    without its address, which tells nothing. The one place reprs are shortened."""
    if isinstance(value, types.FunctionType):
        return f"<function {value.__qualname__}>"
    try:
        text = " ".join(repr(value).split())
    except Exception:  # noqa: BLE001 - a repr that fails still names the type
        return f"<{type(value).__name__} object>"
    if len(text) <= limit:
        return text
    stack: list[str] = []  # open brackets and quotes, innermost last
    cut, cut_stack = 0, []  # the last boundary seen and what was open there
    index = 0
    while index < limit - 3:
        char = text[index]
        if stack and stack[-1] in "'\"":
            if char == "\\":
                index += 1
            elif char == stack[-1]:
                stack.pop()
        elif char in "'\"" or char in _CLOSERS:
            stack.append(char)
        elif stack and char == _CLOSERS.get(stack[-1]):
            stack.pop()
        index += 1
        if (char in _CLOSERS or char == " ") and not (stack and stack[-1] in "'\"" and char == " "):
            cut, cut_stack = index, list(stack)
    if cut == 0:  # one long token (a name, a string): cut it at the limit
        cut, cut_stack = limit - 3, stack
    closers = "".join(_CLOSERS.get(opened, opened) for opened in reversed(cut_stack))
    return text[:cut] + "..." + closers

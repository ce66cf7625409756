"""A prepared operator's ``__call__`` written for its own call: the prepared number of
positional arguments, the prepared tangent keywords by name, and the result's rebuild
inlined.

On a small model the prepared call is one compiled call whose own cost is a few
microseconds, and the Python around it is timed beside it: each frame, each packing of
``*args`` and ``**kwargs`` into a tuple and a dict, each attribute read on ``self`` shows in
the ratio to the raw ``jax.jit`` call. Right after the compiled code ran, the interpreter's
own code and data are cold in the CPU's caches, so one generic frame costs there about
what the dispatch of a small jitted call does. The generated method is one frame that
binds the arguments by position, reads everything else from its closure, and builds the
result in place. Any call of another shape (fewer or more arguments, other keywords, an
annotated argument where the compiled call would take it) goes to the generic path,
`Prepared._generic_call`, which treats it as before.

Where the framework's own dispatch can be the whole call (a strict JAX call whose result
JAX's dispatch can build: ``backends/_jax_dispatch.py``), there is no frame at all and this
method is not made; it serves the rest (an Equinox module's call, a result holding a
namedtuple, a program that calls back into Python, torch).
"""

from __future__ import annotations

import keyword
from typing import Any, Callable

from ._annotations import Annotation

_MISSING: Any = object()  # an argument not given (a parameter's default)
_MISSED: Any = object()  # the compiled call declined the arguments
_LOCALS = frozenset(("leaves", "error"))  # the generated method's own local names


def specialised_call(
    arity: int,
    seed_names: tuple[str, ...],
    direct: Callable[..., Any],
    misses: tuple[type[BaseException], ...],
    rebuild: Callable[[Any], Any] | None,
    takes_annotations: bool,
    generic: Callable[..., Any],
    missed: Callable[..., Any],
    report: Callable[[Any, BaseException], None],
) -> Callable[..., Any] | None:
    """``__call__`` for a prepared operator whose compiled call ``direct`` takes ``arity``
    positional arguments and the keywords ``seed_names``, returns leaves that ``rebuild``
    turns into the result (or the result, where ``rebuild`` is None), and declines the
    arguments by raising one of ``misses``. ``generic(self, args, kwargs)`` serves a call of
    another shape, ``missed(self, args, kwargs)`` one that ``direct`` declined;
    ``report(self, error)`` explains an error before it propagates. None where a keyword's
    name cannot be a parameter's."""
    if any(not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_") or name in _LOCALS for name in seed_names):
        return None
    positional = [f"_a{index}" for index in range(arity)]
    given = "(" + "".join(f"{name}, " for name in positional) + ")"
    seeds = "{" + ", ".join(f"{name!r}: {name}" for name in seed_names) + "}"
    parameters = ", ".join(
        [
            "_self",
            *(f"{name}=_MISSING" for name in positional),
            *(["/"] if positional else []),
            "*_more",
            *(f"{name}=_MISSING" for name in seed_names),
            "**_extra",
        ]
    )
    # Positional parameters fill in order: the last one given means all of them are.
    unusual = [f"{positional[-1]} is _MISSING"] if positional else []
    unusual += [f"{name} is _MISSING" for name in seed_names] + ["_more", "_extra"]
    if takes_annotations:
        unusual += [f"isinstance({name}, _Annotation)" for name in positional]
    call_arguments = ", ".join([*positional, *(f"{name}={name}" for name in seed_names)])
    names: dict[str, Any] = {
        "_MISSING": _MISSING, "_MISSED": _MISSED, "_Annotation": Annotation, "_direct": direct, "_misses": misses,
        "_generic": generic, "_missed": missed, "_report": report, "_given": _given,
    }
    source = getattr(rebuild, "source", None)
    if rebuild is None:
        result = "leaves"
    elif source is not None:
        result = source
        names.update(rebuild.names)  # type: ignore[attr-defined]  # a generated rebuilder's constants
    else:
        names["_rebuild"] = rebuild
        result = "_rebuild(leaves)"
    lines = [
        f"def __call__({parameters}):",
        f"    if {' or '.join(unusual)}:",
        f"        return _generic(_self, *_given({given}, _more, {seeds}, _extra))",
        "    try:",
        f"        leaves = _direct({call_arguments})",
        "    except _misses:",
        "        leaves = _MISSED",
        "    except Exception as error:",
        "        _report(_self, error)",
        "        raise",
        "    if leaves is _MISSED:  # the checked path, outside the handler: its error is not chained to the miss",
        f"        return _missed(_self, {given}, {seeds})",
        f"    return {result}",
    ]
    exec(compile("\n".join(lines), "<activity prepared call>", "exec"), names)  # noqa: S102 - built above from names checked as identifiers
    return names["__call__"]  # type: ignore[no-any-return]


def _given(positional: tuple[Any, ...], more: tuple[Any, ...], seeds: dict[str, Any], extra: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments as ``*args, **kwargs`` would have them: those not given left out."""
    args = (*(value for value in positional if value is not _MISSING), *more)
    return args, {**{name: value for name, value in seeds.items() if value is not _MISSING}, **extra}

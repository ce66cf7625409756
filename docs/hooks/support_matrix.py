"""mkdocs hook: render the backend support matrix from `Backend.capabilities()`.

Wherever a page contains the line ``<!-- support-matrix -->``, it is replaced by
a table generated from the backends' own declarations, so the documentation
cannot drift from the code. `tests/test_docs.py` imports `support_matrix()`.
"""

from __future__ import annotations

MARKER = "<!-- support-matrix -->"
KIND_LABELS = {"active": "A", "constant": "C", "cache": "K"}


def backends() -> list:
    import activity as ad

    return [
        ad.AutoJAX(),
        ad.AutoTorch(),
        ad.AutoFiniteDifferences(),
        ad.SecondOrder(ad.AutoJAX(), ad.AutoJAX()),
        ad.SecondOrder(ad.AutoFiniteDifferences(), ad.AutoJAX()),
        ad.SecondOrder(ad.AutoJAX(), ad.AutoFiniteDifferences()),
    ]


def label(backend) -> str:
    """A short column label: the class name, with the two halves of a `SecondOrder`."""
    name = type(backend).__name__
    if name == "SecondOrder":
        return f"{name}({label(backend.outer)}, {label(backend.inner)})"
    return name


def _cell(capabilities: dict, operator: str) -> str:
    marks = []
    for kind, label in KIND_LABELS.items():
        modes = [m for m in ("unprepared", "prepared") if capabilities[(operator, kind, m)]]
        if len(modes) == 2:
            marks.append(label)
        elif modes:
            marks.append(f"{label} ({modes[0]} only)")
    return " ".join(marks) if marks else "no"


def support_matrix() -> str:
    """The operators x backends table; each cell lists the annotation kinds supported."""
    from activity._operators._names import OPERATORS

    columns = backends()
    tables = [backend.capabilities() for backend in columns]
    lines = [
        "| operator | " + " | ".join(f"`{label(b)}`" for b in columns) + " |",
        "| --- | " + " | ".join("---" for _ in columns) + " |",
    ]
    for operator in OPERATORS:
        lines.append(f"| `{operator}` | " + " | ".join(_cell(t, operator) for t in tables) + " |")
    return "\n".join(lines)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (mkdocs hook signature)
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, support_matrix())

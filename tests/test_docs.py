"""The documentation: every ```python block in docs/ (and the README) runs, and `mkdocs build --strict` passes.

Each page runs in its own process, forked from one that has imported the frameworks
(`_forkserver.py`), in a fresh temporary directory, with its blocks executed in order in one
namespace. A block whose fence carries a
``title="name.py"`` (a file shown on the page, e.g. a pytest module) is written
to that file in the directory instead of executed; later blocks may run it.

Run one page by hand: ``python tests/test_docs.py docs/concepts.md``.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p.relative_to(ROOT).as_posix() for p in DOCS.rglob("*.md"))
CODE_PAGES = [*PAGES, "README.md"]
FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
TITLE = re.compile(r'title="([^"]+\.py)"')


def fences(text: str) -> list[tuple[int, str, str]]:
    """``(first line number, the fence's options, code)`` for each python block, in order."""
    return [(text.count("\n", 0, m.start(2)) + 1, m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def code_blocks(text: str) -> list[tuple[int, str | None, str]]:
    """``(first line number, file title or None, code)`` for each python block, in order."""
    blocks = []
    for line, options, code in fences(text):
        title = TITLE.search(options)
        blocks.append((line, title.group(1) if title else None, code))
    return blocks


def _prints(tree: ast.AST) -> bool:
    """Whether running the code calls ``print`` itself (not only inside a function it defines,
    whose output shows under the block that calls it)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
            return True
        stack.extend(ast.iter_child_nodes(node))
    return False


def blocks_without_output(text: str) -> list[tuple[int, str]]:
    """``(line, what to do)`` for each python block whose output the site would not show.

    markdown-exec shows what a block prints only where its fence says ``exec="on"`` and
    ``result="..."``; a block ending in a bare expression (``grads["w"]``), whose value a REPL
    would show, shows nothing even then. A call at the end is not counted: its value may be
    None. Titled blocks are files, never run on their own.
    """
    found = []
    for line, options, code in fences(text):
        if TITLE.search(options):
            continue
        tree = ast.parse(code)
        if _prints(tree) and not ('exec="on"' in options and "result=" in options):
            found.append((line, 'prints: fence it ```python exec="on" source="material-block" result="text" session=...'))
        last = tree.body[-1] if tree.body else None
        if isinstance(last, ast.Expr) and not isinstance(last.value, (ast.Call, ast.Constant)):
            found.append((line + last.lineno - 1, "ends in a bare expression, whose value shows nowhere: print it"))
    return found


def run_page(page: str) -> None:
    """Execute a page's blocks in order, in one namespace, in the current directory."""
    path = ROOT / page
    namespace: dict = {"__name__": "__main__"}
    for line, title, code in code_blocks(path.read_text()):
        if title:
            Path(title).write_text(code)
            continue
        print(f"--- {page}:{line}", flush=True)
        exec(compile("\n" * (line - 1) + code, str(path), "exec"), namespace)


def _support_matrix_module():
    spec = importlib.util.spec_from_file_location("support_matrix", DOCS / "hooks" / "support_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    run_page(Path(sys.argv[1]).resolve().relative_to(ROOT).as_posix())
    sys.exit(0)


import pytest  # noqa: E402  (not needed to run one page by hand)
from _forkserver import ForkServer  # noqa: E402


RUN_PAGES = [p for p in CODE_PAGES if code_blocks((ROOT / p).read_text())]


@pytest.fixture(scope="module")
def page_runs(tmp_path_factory):
    """Every page run in its own directory and process, one per core at a time; tests wait for their own."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    jobs = {page: ([Path(__file__).resolve(), ROOT / page], tmp_path_factory.mktemp(Path(page).stem)) for page in RUN_PAGES}
    server = ForkServer(jobs, tmp_path_factory.mktemp("page_runs"), env)
    yield server
    server.close()


@pytest.mark.parametrize("page", RUN_PAGES)
def test_page_code_runs(page, page_runs):
    code, stdout, stderr = page_runs.result(page)
    assert code == 0, f"{page} failed:\n{stdout[-3000:]}\n{stderr[-5000:]}"


PLANTED = """
```python
x = 1
print(x)
```

```python exec="on" source="material-block" result="text" session="p"
print("shown")
```

```python exec="on" source="material-block" session="p"
print("run, but not shown as a result")
```

```python exec="on" session="p"
def show(value):
    print(value)
```

```python exec="on" session="p"
y = {"w": 2}
y["w"]
```

```python exec="on" session="p"
show(y)
```

```python title="test_file.py"
print("a file, not a block")
```

```python
for i in range(2):
    print(i)
```
"""


def test_blocks_without_output_finds_each_planted_block():
    found = blocks_without_output(PLANTED)
    assert [line for line, _ in found] == [3, 12, 22, 34], found
    assert "prints" in found[0][1] and "bare expression" in found[2][1]


def test_every_block_that_prints_shows_its_output():
    found = {page: blocks_without_output((ROOT / page).read_text()) for page in PAGES}
    assert {page: where for page, where in found.items() if where} == {}


def test_there_are_at_least_ten_pages_and_all_are_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [p.removeprefix("docs/") for p in PAGES]
    assert len(pages) >= 10, pages
    assert [p for p in pages if p not in nav] == []


def test_support_matrix_is_generated_from_capabilities():
    module = _support_matrix_module()
    assert module.MARKER in (DOCS / "backends.md").read_text()
    table = module.support_matrix().splitlines()
    backends = module.backends()
    from activity._operators._names import OPERATORS

    assert len(table) == 2 + len(OPERATORS)
    for row, operator in zip(table[2:], OPERATORS):
        cells = [c.strip() for c in row.strip("|").split("|")][1:]
        for backend, cell in zip(backends, cells):
            for kind, label in module.KIND_LABELS.items():
                supported = backend.capabilities()[(operator, kind, "unprepared")]
                assert (label in cell.split()) == supported, (operator, backend, kind, cell)


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="install the docs extra: pip install -e '.[docs]'")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    backends_page = (tmp_path / "site" / "backends" / "index.html").read_text()
    assert "SecondOrder(AutoJAX, AutoFiniteDifferences)" in backends_page  # the generated table
    assert "<!-- support-matrix -->" not in backends_page
    site = tmp_path / "site"
    api = (site / "api" / "operators" / "index.html").read_text()
    assert 'id="activity.value_gradient_and_hessian"' in api
    _check_executed_output(site)
    _check_api_reference(site)
    assert "activity " + _version() in (site / "index.html").read_text()  # the version, in the header
    changelog = (site / "changelog" / "index.html").read_text()
    assert "0.1.0" in changelog and "Unreleased" in changelog  # CHANGELOG.md, included


def _version() -> str:
    import activity

    return activity.__version__


def _check_executed_output(site: Path) -> None:
    """The errors page shows the messages its blocks produce, as raising them here gives them."""
    import html

    import jax.numpy as jnp

    import activity as ad

    w, x = jnp.ones(2), jnp.ones((3, 2))
    expected = []
    for call in (
        lambda: ad.gradient(lambda w, x: jnp.sum(x @ w), ad.Active(w), x),
        lambda: ad.gradient(lambda w, x: x @ w, ad.Active(w), ad.Constant(x)),
        lambda: ad.prepare(ad.gradient, lambda w, x: jnp.sum(x @ w), ad.Active(w), ad.Constant(x))(w, jnp.ones((5, 2))),
    ):
        with pytest.raises(Exception) as caught:
            call()
        expected.append(f"{type(caught.value).__name__}: {caught.value}")
    errors = (site / "errors" / "index.html").read_text()
    for message in expected:
        assert html.escape(message, quote=False) in errors, message
    install = (site / "install" / "index.html").read_text()
    assert 'is not installed; install it with pip install "activity-ad[jax]"' in html.unescape(install)


def _inventory(site: Path) -> set[str]:
    """The names objects.inv lists: what other projects' docs can link to."""
    import zlib

    data = (site / "objects.inv").read_bytes()
    header_end = 0
    for _ in range(4):  # four header lines, then zlib
        header_end = data.index(b"\n", header_end) + 1
    return {line.split(" ", 1)[0] for line in zlib.decompress(data[header_end:]).decode().splitlines()}


def _check_api_reference(site: Path) -> None:
    import activity
    import activity.testing

    names = _inventory(site)
    public = [f"activity.{n}" for n in activity.__all__] + [f"activity.testing.{n}" for n in activity.testing.__all__]
    assert [n for n in public if n not in names] == []
    backends = (site / "api" / "backends" / "index.html").read_text()
    assert "finalize" not in backends and 'id="activity.Backend.jvp"' not in backends  # internals stay out
    section = backends[backends.index('id="activity.AutoFiniteDifferences"'):backends.index('id="activity.SecondOrder"')]
    for parameter in ("step", "shrink", "max_steps", "retries"):
        assert f"<code>{parameter}</code>" in section, parameter
    assert "required" not in section  # every parameter has a default


def test_public_docstrings_document_their_parameters():
    """Args sections name exactly the parameters of the signature, and say what is returned and raised."""
    import inspect

    import activity as ad
    from activity.testing import Scenario

    from activity._operators._names import OPERATORS

    documented = [getattr(ad, n) for n in OPERATORS] + [ad.prepare]
    documented += [ad.Active, ad.Constant, ad.Cache, ad.AutoFiniteDifferences, ad.SecondOrder, ad.AutoTorch, Scenario]
    for obj in documented:
        doc = inspect.getdoc(obj)
        signature = inspect.signature(obj)
        names = [("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "") + p.name
                 for p in signature.parameters.values()]
        args = re.search(r"^Args:\n((?:    .*\n|\n)*)", doc + "\n", re.MULTILINE)
        assert args, f"{obj.__qualname__} has no Args section"
        listed = re.findall(r"^    (\*{0,2}\w+):", args.group(1), re.MULTILINE)
        assert listed == names, (obj.__qualname__, listed, names)
        assert "Raises:" in doc, obj.__qualname__
        if not isinstance(obj, type):
            assert "Returns:" in doc, obj.__qualname__

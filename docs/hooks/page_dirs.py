"""mkdocs hook: each page's executed blocks run in a fresh directory of their own, with the
page's ``title="name.py"`` blocks written there as files, as `tests/test_docs.py` runs them.

markdown-exec runs ``exec="on"`` blocks in the build's own directory, and never a titled block
(a file the page shows, such as a pytest module that a later block runs). Giving every executed
block of a page ``workdir=`` one temporary directory holding the page's files lets the later
block find its file, and keeps whatever a block writes out of the checkout.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

# The fence `tests/test_docs.py` reads: options after ```python, the code, the closing fence.
FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
TITLE = re.compile(r'title="([^"]+\.py)"')
EXEC = 'exec="on"'

_dirs: list[str] = []


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if EXEC not in markdown:
        return markdown
    workdir = tempfile.mkdtemp(prefix="activity-docs-")
    _dirs.append(workdir)

    def fence(match: re.Match) -> str:
        options, code = match.group(1), match.group(2)
        title = TITLE.search(options)
        if title:
            (Path(workdir) / title.group(1)).write_text(code)
        elif EXEC in options:
            options += f' workdir="{workdir}"'
        return f"```python{options}\n{code}```"

    return FENCE.sub(fence, markdown)


def on_post_build(**kwargs: Any) -> None:
    while _dirs:
        shutil.rmtree(_dirs.pop(), ignore_errors=True)

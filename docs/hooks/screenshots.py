"""Build the site and take headless Chromium screenshots of its main pages, 1280 px wide.

``make screenshots`` (or ``python docs/hooks/screenshots.py [OUTDIR]``) writes one PNG per page
into ``build/screenshots``: look at them after changing the theme, the CSS or a wide table.
Needs Debian's ``chromium`` (``apt-get install -y chromium``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = {
    "index": "index.html",
    "install": "install/index.html",
    "operators": "operators/index.html",
    "testing": "testing/index.html",
    "benchmarks": "benchmarks/index.html",
    "backends": "backends/index.html",
    "errors": "errors/index.html",
    "api-operators": "api/operators/index.html",
    "api-backends": "api/backends/index.html",
}
WIDTH, HEIGHT = 1280, 3200
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
]


def browser() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    raise SystemExit("no Chromium found: install it with `apt-get install -y chromium`")


def main(outdir: Path) -> None:
    chromium = browser()
    outdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(site)], cwd=ROOT, check=True)
        for name, page in PAGES.items():
            target = outdir / f"{name}.png"
            subprocess.run(
                [chromium, *FLAGS, f"--user-data-dir={Path(tmp) / 'profile'}", f"--window-size={WIDTH},{HEIGHT}",
                 f"--screenshot={target}", (site / page).as_uri()],
                check=True, capture_output=True, timeout=120,
            )
            print(target)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "build" / "screenshots")

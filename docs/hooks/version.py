"""mkdocs hook: the version in the header and footer, read from the package, so it cannot drift."""

from __future__ import annotations

from typing import Any


def on_config(config: Any) -> Any:
    import activity

    config["site_name"] = f"activity {activity.__version__}"
    config["copyright"] = f"activity-ad {activity.__version__} · MIT License"
    return config

"""Optional frameworks, imported on first use, with an error that names the extra installing them.

`import activity` needs numpy only; JAX, torch and Equinox are imported by the code
that needs them, through `optional`, so a missing one is reported once, in one wording,
naming the ``pip install`` that brings it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

DISTRIBUTION = "activity-ad"

# The extra of activity-ad that installs each optional module.
EXTRA_FOR = {"jax": "jax", "torch": "torch", "equinox": "testing"}


def install_command(module: str) -> str:
    """The ``pip install`` line that brings ``module`` (a top-level name such as ``"jax"``)."""
    extra = EXTRA_FOR.get(module)
    return f'pip install "{DISTRIBUTION}[{extra}]"' if extra else f"pip install {module}"


def missing_error(module: str, needed_by: str) -> ModuleNotFoundError:
    """The error for ``needed_by`` (e.g. ``"AutoJAX()"``) when ``module`` cannot be imported."""
    return ModuleNotFoundError(f"{needed_by}: {module} is not installed; install it with {install_command(module)}", name=module)


def is_installed(module: str) -> bool:
    """Whether ``module`` can be found, without importing it (a blocked or broken entry counts as missing)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(module: str, needed_by: str) -> None:
    """Raise `missing_error` now unless ``module`` can be found; imports nothing."""
    if not is_installed(module):
        raise missing_error(module, needed_by)


def optional(name: str, needed_by: str) -> ModuleType:
    """Import ``name`` (e.g. ``"jax.numpy"``); where its top-level package is missing, raise `missing_error`.

    A missing dependency *of* the framework (jax without jaxlib) keeps the framework's own error,
    which says more than ours could.
    """
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded
    top = name.partition(".")[0]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if (error.name or "").partition(".")[0] != top:
            raise
        raise missing_error(top, needed_by) from error

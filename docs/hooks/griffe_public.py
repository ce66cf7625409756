"""griffe extension for the API reference: public names point at what they are at run time.

``activity.gradient`` is the function ``activity._operators.gradient.gradient``, but read
statically the name ``activity._operators.gradient`` is the submodule of that name (the
function, imported over it at run time, shadows it only when the code runs). Without this,
``::: activity.gradient`` would render the submodule. Each alias of the ``activity``
package whose target is a module, while the live attribute is not, is pointed at the
live object's defining path instead.
"""

from __future__ import annotations

import importlib
import types
from typing import Any

import griffe


class PublicNames(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name != "activity":
            return
        live = importlib.import_module("activity")
        for name in getattr(live, "__all__", ()):
            member = pkg.members.get(name)
            value = getattr(live, name, None)
            if member is None or value is None or isinstance(value, types.ModuleType):
                continue
            if not member.is_alias or not member.final_target.is_module:
                continue
            target = f"{value.__module__}.{value.__qualname__}"
            pkg.set_member(name, griffe.Alias(name, target, parent=pkg))

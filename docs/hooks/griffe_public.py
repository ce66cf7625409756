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
            if not isinstance(member, griffe.Alias) or not member.final_target.is_module:
                continue
            target = f"{value.__module__}.{value.__qualname__}"
            pkg.set_member(name, griffe.Alias(name, target, parent=pkg))


class AttrsConstructors(griffe.Extension):
    """attrs classes get their generated ``__init__``, so the reference shows how to construct them.

    Read statically, an attrs class has no ``__init__``: its signature and the defaults of the
    documented parameters would be missing (a default would read "required"). The signature is
    taken from the live class, which attrs has given the real one.
    """

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name == "activity":
            self._visit(pkg)

    def _visit(self, obj: griffe.Object | griffe.Alias) -> None:
        for member in list(obj.members.values()):
            if member.is_alias:
                continue
            if member.is_module:
                self._visit(member)
            elif member.is_class:
                self._add_init(member)
                self._visit(member)

    def _add_init(self, cls: griffe.Object | griffe.Alias) -> None:
        import inspect

        import attrs

        if "__init__" in cls.members:
            return
        try:
            live = getattr(importlib.import_module(cls.module.path), cls.name)
        except (ImportError, AttributeError):
            return
        if not (isinstance(live, type) and attrs.has(live)):
            return
        kinds = {
            inspect.Parameter.POSITIONAL_OR_KEYWORD: griffe.ParameterKind.positional_or_keyword,
            inspect.Parameter.KEYWORD_ONLY: griffe.ParameterKind.keyword_only,
            inspect.Parameter.VAR_POSITIONAL: griffe.ParameterKind.var_positional,
            inspect.Parameter.VAR_KEYWORD: griffe.ParameterKind.var_keyword,
            inspect.Parameter.POSITIONAL_ONLY: griffe.ParameterKind.positional_only,
        }
        fields = attrs.fields_dict(live)
        parameters = [griffe.Parameter("self", kind=griffe.ParameterKind.positional_or_keyword)]
        for parameter in inspect.signature(live).parameters.values():
            annotation, default = parameter.annotation, parameter.default
            field = fields.get(parameter.name) or fields.get("_" + parameter.name)
            declared = field.default if field is not None else None
            factory = getattr(declared, "factory", None)
            if factory is not None and not getattr(declared, "takes_self", False):
                default = factory()  # what a call without it gets, not attrs' NOTHING
            parameters.append(
                griffe.Parameter(
                    parameter.name,
                    annotation=None if annotation is inspect.Parameter.empty else str(annotation),
                    kind=kinds[parameter.kind],
                    default=None if default is inspect.Parameter.empty else repr(default),
                )
            )
        init = griffe.Function("__init__", parameters=griffe.Parameters(*parameters), returns="None", parent=cls)
        cls.set_member("__init__", init)

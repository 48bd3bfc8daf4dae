"""The config type of a component's parameter, read from its annotation: what the recipe's
config check holds a value of a `_component_` section to (`loss.epsilon_low=0.2x` is refused by
name before GRPOLoss compares a string with a number)."""

from __future__ import annotations

import inspect
import types
import typing

import torch

__all__ = ["import_component", "parameter_kinds"]

_KINDS = {int: "int", float: "float", bool: "bool", str: "str"}


def parameter_kinds(target) -> dict[str, tuple[str, bool]]:
    """{parameter name: (kind, nullable)} for the parameters of `target` (a class or a
    function) annotated with int, float, bool or str, optionally with None; a tensor in a
    union is left out (a config gives no tensors: AdamW's lr is float | Tensor). Parameters
    with other annotations, or a target whose hints cannot be resolved, are not listed."""
    function = target.__init__ if inspect.isclass(target) else target
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # noqa: BLE001 - unresolvable hints: nothing to check against
        return {}
    out = {}
    for name, hint in hints.items():
        args = (typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType)
                else (hint,))
        nullable = type(None) in args
        simple = [a for a in args if a is not type(None) and a is not torch.Tensor]
        if len(simple) == 1 and simple[0] in _KINDS:
            out[name] = (_KINDS[simple[0]], nullable)
    return out


def import_component(path: str):
    """The object a config's `_component_` path names (torchtune's resolver, as `tune run`
    instantiates it); raises what the import raises."""
    from torchtune.config._utils import _get_component_from_path

    return _get_component_from_path(path)

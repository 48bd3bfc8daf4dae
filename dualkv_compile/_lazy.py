"""Public names of a package imported on first use (PEP 562).

`import dualkv_compile` and the `dualkv` command then start without importing torch's
compiler stack (about 2 s on a laptop core); the names are imported when first read.

A submodule (`dualkv_compile.attention`, `.layout`, ...) is imported when first read too, as
the eager package made it readable. The custom ops (`torch.ops.dualkv.*`) are registered when
the modules that define them are imported, e.g. by `optimize()`; code that loads a saved graph
calling them imports `dualkv_compile.attention.op` (and `dualkv_compile.layout.inputs`) first.

Some public names are also submodule names (`dualkv_compile.optimize` is a function and a
module). Python's import system sets a package's attribute to each submodule it loads, which
would replace the function by the module once anything imported the submodule first. The
package's module class therefore keeps a public name from being overwritten by a submodule.

This module must import nothing but the standard library.
"""

from __future__ import annotations

import importlib
import sys
import types

__all__ = ["lazy_package"]


class _LazyPackage(types.ModuleType):
    _dualkv_exports: dict[str, str]

    def __getattr__(self, name):  # only called for names not yet in the module's namespace
        where = self._dualkv_exports.get(name)
        if where is None:  # a submodule, imported on first read as the eager package did
            if name.startswith("__"):
                raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
            try:
                return importlib.import_module(f"{self.__name__}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{self.__name__}.{name}":
                    raise  # the submodule exists and one of its imports is missing
                raise AttributeError(f"module {self.__name__!r} has no attribute "
                                     f"{name!r}") from None
        value = getattr(importlib.import_module(where, self.__name__), name)
        types.ModuleType.__setattr__(self, name, value)
        return value

    def __setattr__(self, name, value):
        # the import system binding a submodule over a public name of the same spelling
        if isinstance(value, types.ModuleType) and name in self._dualkv_exports:
            return
        types.ModuleType.__setattr__(self, name, value)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(self._dualkv_exports))


def lazy_package(package: str, exports: dict[str, str]) -> None:
    """Make `package` import each public name `n` from its module `exports[n]` (relative to the
    package, e.g. ".optimize") when `n` is first read."""
    module = sys.modules[package]
    types.ModuleType.__setattr__(module, "_dualkv_exports", dict(exports))
    module.__class__ = _LazyPackage

import subprocess
import sys

import pytest

SCRIPT = """
import torch
def refuse(*a, **k):
    raise RuntimeError("CUDA was initialised")
torch.cuda._lazy_init = refuse
torch.cuda.init = refuse
import dualkv_compile, dualkv_compile.passes, dualkv_compile.tools, dualkv_compile.models
for package in (dualkv_compile, dualkv_compile.models):  # the names are imported when read
    for name in package.__all__:
        getattr(package, name)
import dualkv_compile.attention.block_mask, dualkv_compile.attention.kernel_options, dualkv_compile.testing
assert not torch.cuda.is_initialized()
print("ok")
"""


def test_import_does_not_initialise_cuda():
    # A fresh interpreter in which any CUDA initialisation raises.
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def _fresh(script: str) -> str:
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_public_name_is_not_replaced_by_its_submodule():
    # `optimize` is a function and a module: importing the module first (as the recipe's
    # imports do) must leave `dualkv_compile.optimize` the function
    assert _fresh("import dualkv_compile.optimize, dualkv_compile.models.qwen3\n"
                  "import dualkv_compile as dk, dualkv_compile.models as m\n"
                  "print(dk.optimize.__module__, m.qwen3.__module__, callable(m.qwen3))"
                  ) == "dualkv_compile.optimize dualkv_compile.models.qwen3 True"
    assert _fresh("import dualkv_compile as dk\n"
                  "f = dk.optimize\n"
                  "import dualkv_compile.optimize\n"
                  "print(dk.optimize is f, 'optimize' in dir(dk))") == "True True"


def test_submodules_are_readable_after_a_plain_import():
    # the eager package made them attributes; docs/api.md reads ...attention.registry.KERNELS
    assert _fresh("import dualkv_compile as dk\n"
                  "print(sorted(dk.attention.registry.KERNELS)[0], dk.layout.__name__, "
                  "dk.stats.counters is dk.counters)") == "auto dualkv_compile.layout True"


def test_an_unknown_name_is_an_attribute_error():
    import dualkv_compile

    with pytest.raises(AttributeError, match="has no attribute 'optimise'"):
        dualkv_compile.optimise  # noqa: B018


def test_subpackages_are_installed_under_the_package_name():
    import dualkv_compile.passes
    import dualkv_compile.tools

    assert dualkv_compile.passes.__name__ == "dualkv_compile.passes"
    assert dualkv_compile.tools.__name__ == "dualkv_compile.tools"


def test_every_source_package_is_listed_for_installation():
    # pyproject.toml names the packages one by one (passes/ and tools/ map into the package):
    # a folder left out is missing from a non-editable install
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib", reason="tomllib (Python 3.11+) reads pyproject")

    root = Path(__file__).resolve().parents[1]
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    where = {name: root / folder for name, folder in config["package-dir"].items()}
    found = set()
    for name, folder in where.items():
        for init in folder.rglob("__init__.py"):
            parts = init.parent.relative_to(folder).parts
            found.add(".".join((name, *parts)))
    assert found <= set(config["packages"]), sorted(found - set(config["packages"]))

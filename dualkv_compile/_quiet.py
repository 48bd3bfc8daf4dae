"""Third-party noise no user can act on, dropped where it is emitted.

- torchao 0.15 (torchtune's pin) logs "Skipping import of cpp extensions due to incompatible
  torch version" at import under every torch it was not built for (its Python paths, all
  torchtune uses, still work). `tune run` imports torchao before any of our code runs, so the
  filter is installed twice: by a one-line ``.pth`` file the wheel puts in site-packages (run
  at interpreter start, importing only ``logging``) and by ``dualkv_compile/__init__``.
- setuptools prints an "Editable installation" notice at ``pip install -e`` (see below).

This module must import nothing but the standard library: setuptools loads it at build time
(``[tool.setuptools.cmdclass]`` in pyproject.toml), where torch is not installed.
"""

import logging
import os
import warnings

MESSAGE_PREFIX = "Skipping import of cpp extensions due to incompatible torch version"
PTH_NAME = "dualkv_compile_quiet_torchao.pth"
PTH_LINE = ('import logging; logging.getLogger("torchao").addFilter('
            f'lambda record: not record.getMessage().startswith("{MESSAGE_PREFIX}"))\n')


def install_filter():
    """Add the filter to torchao's logger in this process (idempotent)."""
    logger = logging.getLogger("torchao")
    if not any(getattr(f, "_dualkv_quiet", False) for f in logger.filters):
        def drop(record):
            return not record.getMessage().startswith(MESSAGE_PREFIX)
        drop._dualkv_quiet = True
        logger.addFilter(drop)


def _write_pth(directory):
    path = os.path.join(directory, PTH_NAME)
    with open(path, "w") as f:
        f.write(PTH_LINE)
    return path


def __getattr__(name):
    # setuptools is needed only at build time, so the build commands are made on first access.
    if name == "BuildPyWithPth":
        from setuptools.command.build_py import build_py

        class BuildPyWithPth(build_py):
            """setuptools' build_py, plus the ``.pth`` file at the wheel's root."""

            def run(self):
                super().run()
                _write_pth(self.build_lib)

            def get_outputs(self, include_bytecode=True):
                return super().get_outputs(include_bytecode) + [
                    os.path.join(self.build_lib, PTH_NAME)]

        return BuildPyWithPth
    if name == "EditableWheelWithPth":
        from setuptools.command.editable_wheel import editable_wheel

        class EditableWheelWithPth(editable_wheel):
            """An editable wheel ships no build_lib files, so the ``.pth`` goes into the
            unpacked wheel itself (its root is site-packages). setuptools' "Editable
            installation" notice (folders named like the package may shadow it: here the
            package's own source folder) is also install noise and is dropped."""

            def run(self):
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="Editable installation")
                    super().run()

            def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
                files, mapping = super()._run_build_commands(
                    dist_name, unpacked_wheel, build_lib, tmp_dir)
                _write_pth(unpacked_wheel)
                return files, mapping

        return EditableWheelWithPth
    raise AttributeError(name)

import subprocess
import sys

SCRIPT = """
import torch
def refuse(*a, **k):
    raise RuntimeError("CUDA was initialised")
torch.cuda._lazy_init = refuse
torch.cuda.init = refuse
import dualkv_compile, dualkv_compile.passes, dualkv_compile.tools
import dualkv_compile.attention.block_mask, dualkv_compile.attention.kernel_options, dualkv_compile.testing
assert not torch.cuda.is_initialized()
print("ok")
"""


def test_import_does_not_initialise_cuda():
    # A fresh interpreter in which any CUDA initialisation raises.
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_subpackages_are_installed_under_the_package_name():
    import dualkv_compile.passes
    import dualkv_compile.tools

    assert dualkv_compile.passes.__name__ == "dualkv_compile.passes"
    assert dualkv_compile.tools.__name__ == "dualkv_compile.tools"

"""dualkv_compile: compute each shared prompt once in GRPO/DAPO policy updates.

Importing this package must not initialise CUDA (tests/test_import.py checks it).
"""

from ._quiet import install_filter as _install_filter

_install_filter()

from .attention.op import shared_prefix_attention
from .config import DualKVConfig
from .layout.plan import MicroBatchPlan, micro_batch_rows, plan_micro_batches
from .optimize import DualKVModel, optimize
from .layout.packing import PackedBatch, pack
from .passes._common import Refusal
from .stats import counters

__version__ = "0.1.0"

__all__ = [
    "DualKVConfig",
    "DualKVModel",
    "MicroBatchPlan",
    "PackedBatch",
    "Refusal",
    "counters",
    "micro_batch_rows",
    "optimize",
    "pack",
    "plan_micro_batches",
    "shared_prefix_attention",
    "__version__",
]

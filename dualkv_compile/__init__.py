"""dualkv_compile: compute each shared prompt once in GRPO/DAPO policy updates.

Importing this package must not initialise CUDA (tests/test_import.py checks it).
"""

import logging as _logging


class _KnownNoise(_logging.Filter):
    """torchao 0.15 (torchtune's pin) logs this at import under every torch it was not built
    for; nothing a user can act on (its Python paths work), so it is dropped."""

    def filter(self, record):
        return not record.getMessage().startswith(
            "Skipping import of cpp extensions due to incompatible torch version")


_logging.getLogger("torchao").addFilter(_KnownNoise())

from .attention.op import shared_prefix_attention  # noqa: E402
from .config import DualKVConfig
from .layout.plan import MicroBatchPlan, micro_batch_rows, plan_micro_batches
from .optimize import DualKVModel, optimize
from .layout.packing import PackedBatch, pack
from .stats import counters

__version__ = "0.1.0"

__all__ = [
    "DualKVConfig",
    "DualKVModel",
    "MicroBatchPlan",
    "PackedBatch",
    "counters",
    "micro_batch_rows",
    "optimize",
    "pack",
    "plan_micro_batches",
    "shared_prefix_attention",
    "__version__",
]

"""dualkv_compile: compute each shared prompt once in GRPO/DAPO policy updates.

Importing this package must not initialise CUDA (tests/test_import.py checks it).
"""

from .attention import shared_prefix_attention
from .config import DualKVConfig
from .optimize import DualKVModel, optimize
from .packing import PackedBatch, pack
from .stats import counters

__version__ = "0.1.0"

__all__ = [
    "DualKVConfig",
    "DualKVModel",
    "PackedBatch",
    "counters",
    "optimize",
    "pack",
    "shared_prefix_attention",
    "__version__",
]

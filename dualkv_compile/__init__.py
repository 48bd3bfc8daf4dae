"""dualkv_compile: compute each shared prompt once in GRPO/DAPO policy updates.

Importing this package must not initialise CUDA (tests/test_import.py checks it). Its public
names are imported when first read (`_lazy.py`), so that the `dualkv` command starts fast.
"""

from ._lazy import lazy_package as _lazy_package
from ._quiet import install_filter as _install_filter

_install_filter()

__version__ = "0.1.0"

_EXPORTS = {
    "DualKVConfig": ".config",
    "DualKVModel": ".optimize",
    "MicroBatchPlan": ".layout.plan",
    "PackedBatch": ".layout.packing",
    "Refusal": ".passes._common",
    "counters": ".stats",
    "micro_batch_rows": ".layout.plan",
    "optimize": ".optimize",
    "pack": ".layout.packing",
    "plan_micro_batches": ".layout.plan",
    "shared_prefix_attention": ".attention.op",
}
__all__ = [*_EXPORTS, "__version__"]

_lazy_package(__name__, _EXPORTS)

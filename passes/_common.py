"""Shared by the passes: the refusal error, node metadata access, cache ids."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch.fx as fx

__all__ = ["REWRITTEN", "Refusal", "example", "op_name", "source_line", "pass_uuid"]


class Refusal(Exception):
    """A pass cannot prove the rewrite exact; the message names the op and its source line."""


# node.meta key marking the flex_attention calls attention_rewrite inserted (token_locality
# trusts only those)
REWRITTEN = "dualkv_rewritten_attention"


def example(node):
    """The fake value Dynamo recorded for `node` (or the constant itself)."""
    if not isinstance(node, fx.Node):
        return node
    return node.meta.get("example_value", node.meta.get("val"))


def op_name(node: fx.Node) -> str:
    """The op a node calls, as a bare name: a method's name ("view"), or a function's
    ("getitem" for operator.getitem, "flex_attention" for a higher-order op)."""
    if node.op == "call_method":
        return node.target
    return getattr(node.target, "__name__", str(node.target)).split(".")[-1]


def source_line(node: fx.Node) -> str:
    """'file:line  code' of the user code that produced `node`, or its name."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    frames = [(lines[i], lines[i + 1] if i + 1 < len(lines) else "")
              for i in range(len(lines)) if lines[i].startswith("File ")]
    # the innermost frame outside torch itself: the model's own line, not F.linear's
    own = [f for f in frames if "/torch/" not in f[0].replace("\\", "/")]
    if own or frames:
        where, code = (own or frames)[-1]
        return f"{where}: {code}"
    return f"node {node.name} ({node.target})"


def pass_uuid(*paths: str) -> str:
    """A cache id that changes whenever the pass's source (these files) changes."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()


@functools.cache
def regions_ops() -> frozenset:
    """The opaque attention ops the rewrite may insert instead of flex: every registry kernel
    with an op (registered by region_ops.py and flash_regions.py)."""
    import dualkv_compile.attention.op  # noqa: F401  (registers the ops)
    from dualkv_compile.attention.registry import KERNELS

    return frozenset(k.graph_op().default for k in KERNELS.values() if k.op_name is not None)


@functools.cache
def token_local_ops() -> frozenset:
    """Opaque ops whose contract is token-local in their leading token arguments: the grouped
    MoE expert dispatch (models/moe_experts.py)."""
    from dualkv_compile.models.moe_experts import moe_experts

    return frozenset({moe_experts._opoverload})

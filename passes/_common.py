"""Shared by the passes: the refusal error, node metadata access, cache ids."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch.fx as fx

__all__ = ["Refusal", "example", "source_line", "pass_uuid"]


class Refusal(Exception):
    """A pass cannot prove the rewrite exact; the message names the op and its source line."""


def example(node):
    """The fake value Dynamo recorded for `node` (or the constant itself)."""
    if not isinstance(node, fx.Node):
        return node
    return node.meta.get("example_value", node.meta.get("val"))


def source_line(node: fx.Node) -> str:
    """'file:line  code' of the user code that produced `node`, or its name."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File "):
            code = lines[i + 1] if i + 1 < len(lines) else ""
            return f"{lines[i]}: {code}"
    return f"node {node.name} ({node.target})"


def pass_uuid(path: str) -> str:
    """A cache id that changes whenever the pass's source changes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()

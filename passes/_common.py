"""Shared by the passes: the refusal error, node metadata access, cache ids."""

from __future__ import annotations

import functools
import hashlib
import inspect
import operator
from pathlib import Path

import torch
import torch.fx as fx
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["REWRITTEN", "Refusal", "arg_of", "eliminate_dead_code", "example", "may_write",
           "op_name", "source_line", "pass_uuid", "storage", "written"]


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


# keyword spellings torch accepts for one argument (numpy's axis for dim)
_ALIASES = {"dim": ("dim", "axis")}


def arg_of(node: fx.Node, pos: int, keys, default=None):
    """An argument of `node`, by keyword (any of `keys`, with torch's aliases) or at `pos`."""
    keys = (keys,) if isinstance(keys, str) else keys
    for key in (alias for k in keys for alias in _ALIASES.get(k, (k,))):
        if key in node.kwargs:
            return node.kwargs[key]
    return node.args[pos] if len(node.args) > pos else default


_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul,
                      operator.iand, operator.ior, operator.ixor, operator.ilshift,
                      operator.irshift}
# the same as methods (m.__ior__(x)), and item assignment
_INPLACE_DUNDERS = {f"__{op.__name__}__" for op in _INPLACE_OPERATORS} | {"__setitem__"}


def may_write(node: fx.Node) -> bool:
    """Conservatively: `node` may write into one of its inputs or into an `out=` tensor
    (x.mul_(), x += y, x[i] = y, torch.relu_, F.relu(x, inplace=True), torch._foreach_copy_,
    ...)."""
    if node.op not in ("call_method", "call_function"):
        return False
    schema = _schema_of(node.target)
    if schema is not None:  # torch.ops.aten.mul_.Scalar, a custom op: its schema says (its
        return schema.is_mutable or "out" in node.kwargs  # name, "Scalar", would not)
    if node.target in _INPLACE_OPERATORS or "out" in node.kwargs or _inplace_flag(node):
        return True
    name = op_name(node)
    if getattr(node.target, "__module__", None) in ("_operator", "operator"):
        return name == "setitem"  # and_, or_, not_, is_ are the plain `&`, `|`, `not`, `is`
    return name in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))


def written(node: fx.Node) -> list:
    """The values an op that may write (may_write) writes into: its `out=` tensor(s), else its
    first argument (a list of tensors for torch._foreach_*_); for an op with a schema, the
    arguments it marks written."""
    schema = _schema_of(node.target)
    if schema is not None and "out" not in node.kwargs:
        values = [node.kwargs[a.name] if a.kwarg_only or a.name in node.kwargs else
                  node.args[i] if i < len(node.args) else None
                  for i, a in enumerate(schema.arguments)
                  if a.alias_info is not None and a.alias_info.is_write]
        targets = [t for v in values for t in (v if isinstance(v, (list, tuple)) else [v])]
        return [t for t in targets if isinstance(t, fx.Node)]
    target = node.kwargs.get("out", node.args[0] if node.args else None)
    targets = list(target) if isinstance(target, (list, tuple)) else [target]
    return [t for t in targets if isinstance(t, fx.Node)]  # a constant holds no graph memory


def _schema_of(target):
    """The schema of an op overload (torch.ops.ns.op.overload); for an overload packet
    (torch.ops.ns.op), its first overload's (aten.mul: Tensor, pure; aten.mul_: Tensor,
    mutable; not its out= overload, whose write an `out` keyword shows); else None."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema
    if isinstance(target, torch._ops.OpOverloadPacket):
        names = target.overloads()
        return getattr(target, names[0])._schema if names else None
    return None


def _inplace_flag(node: fx.Node) -> bool:
    """An `inplace` argument not literally False, by keyword or by position (Dynamo records
    F.relu(y, True), and the inlined nn.ReLU6 / Hardtanh / ELU forwards, as called); where the
    call cannot be bound to the function's signature, any argument named so counts."""
    if node.kwargs.get("inplace", False) is not False:
        return True
    if node.op != "call_function":
        return False
    try:
        signature = inspect.signature(node.target)
    except (TypeError, ValueError):  # builtins without a Python signature take no inplace
        return False
    if "inplace" not in signature.parameters:
        return False
    try:
        bound = signature.bind(*node.args, **node.kwargs).arguments
    except TypeError:
        return True
    return bound.get("inplace", False) is not False


def storage(node) -> int | None:
    """An id of the memory the fake value of `node` lives in (views share it), or None."""
    value = example(node)
    if not isinstance(value, Tensor):
        return None
    try:
        return StorageWeakRef(value.untyped_storage()).cdata
    except (NotImplementedError, RuntimeError):
        return None


def eliminate_dead_code(graph: fx.Graph) -> int:
    """Erase the ops nothing depends on; returns how many. FX's own eliminate_dead_code takes
    every call_method, and in-place functions such as torch.relu_, as pure, so `y.mul_(2)`
    written as a statement would vanish. Here an op that writes in place (may_write) is kept
    when its memory (fake storage, shared by views) is read by a kept op or is an input's, or
    when that memory is unknown; writes into memory no kept op reads (the model's own mask
    code, which the attention rewrite made dead) go with the rest."""
    nodes = list(graph.nodes)
    memory = {node: storage(node) for node in nodes}
    writes: dict[int | None, list[fx.Node]] = {}  # memory -> the ops writing into it
    for node in nodes:
        if may_write(node):
            for target in written(node):
                writes.setdefault(memory.get(target), []).append(node)
    inputs = {memory[n] for n in nodes if n.op in ("placeholder", "get_attr")}
    stack = [n for n in nodes if n.op in ("placeholder", "output") or n.is_impure()]
    stack += [w for m, ws in writes.items() if m is None or m in inputs for w in ws]
    live: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        if node in live:
            continue
        live.add(node)
        for arg in node.all_input_nodes:  # reading arg reads every write into its memory
            stack.append(arg)
            stack += writes.get(memory[arg], [])
    erased = 0
    for node in reversed(nodes):
        if node not in live and node.op in ("call_function", "call_method", "call_module",
                                            "get_attr"):
            graph.erase_node(node)
            erased += 1
    return erased


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

"""Readable text and an SVG drawing of FX graphs, for `dualkv inspect`."""

from __future__ import annotations

import html

import torch.fx as fx

from dualkv_compile.passes._common import source_line

__all__ = ["graph_text", "attention_region_svg"]


def _target(node: fx.Node) -> str:
    if node.op == "call_method":
        return f".{node.target}"
    if node.op == "call_function":
        name = getattr(node.target, "__name__", str(node.target))
        module = getattr(node.target, "__module__", "") or ""
        if module.startswith("torch") and not module.startswith("torch._"):
            return f"{module.replace('torch.nn.functional', 'F')}.{name}"
        return name
    return node.op


def _arg(a) -> str:
    if isinstance(a, fx.Node):
        return f"%{a.name}"
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner})"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k}: {_arg(v)}" for k, v in a.items()) + "}"
    if callable(a):
        return getattr(a, "__name__", type(a).__name__)
    return repr(a)


def _shape(node: fx.Node) -> str:
    val = node.meta.get("example_value", node.meta.get("val"))
    shape = getattr(val, "shape", None)
    return "" if shape is None else f"  {list(shape)}"


def graph_text(gm: fx.GraphModule) -> str:
    """One line per node: `%name = target(args)  [shape]  # file:line: code`."""
    lines = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            lines.append(f"%{node.name} = input{_shape(node)}")
            continue
        if node.op == "output":
            lines.append(f"return {_arg(node.args[0])}")
            continue
        args = ", ".join([_arg(a) for a in node.args] +
                         [f"{k}={_arg(v)}" for k, v in node.kwargs.items()])
        where = source_line(node) if node.meta.get("stack_trace") else ""
        lines.append(f"%{node.name} = {_target(node)}({args}){_shape(node)}"
                     + (f"  # {where}" if where else ""))
    return "\n".join(lines) + "\n"


def _region(attn: fx.Node, depth_in: int, depth_out: int) -> dict[fx.Node, int]:
    level = {attn: 0}
    frontier = [attn]
    for d in range(1, depth_in + 1):
        frontier = [a for n in frontier for a in n.all_input_nodes
                    if a not in level and a.op != "get_attr"]
        for a in frontier:
            level[a] = -d
    frontier = [attn]
    for d in range(1, depth_out + 1):
        frontier = [u for n in frontier for u in n.users if u not in level]
        for u in frontier:
            level[u] = d
    return level


def attention_region_svg(gm: fx.GraphModule, depth_in: int = 3, depth_out: int = 2) -> str:
    """SVG of the first attention node (flex_attention or the regions op) with its inputs and
    users a few steps out."""
    attn = next((n for n in gm.graph.nodes
                 if getattr(n.target, "__name__", "") in ("flex_attention",
                                                          "regions_attention.default")), None)
    if attn is None:
        raise ValueError("the graph has no attention node (flex_attention or regions_attention)")
    level = _region(attn, depth_in, depth_out)
    columns: dict[int, list[fx.Node]] = {}
    for node, lv in level.items():
        columns.setdefault(lv, []).append(node)
    box_w, box_h, gap_x, gap_y = 190, 34, 60, 14
    lo = min(columns)
    pos = {}
    for lv, nodes in columns.items():
        for i, node in enumerate(nodes):
            pos[node] = (20 + (lv - lo) * (box_w + gap_x), 20 + i * (box_h + gap_y))
    width = 40 + (max(columns) - lo + 1) * (box_w + gap_x)
    height = 40 + max(len(v) for v in columns.values()) * (box_h + gap_y)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="monospace" font-size="11">']
    for node, (x, y) in pos.items():
        for a in node.all_input_nodes:
            if a in pos:
                ax, ay = pos[a]
                out.append(f'<line x1="{ax + box_w}" y1="{ay + box_h / 2}" x2="{x}" '
                           f'y2="{y + box_h / 2}" stroke="#888"/>')
    for node, (x, y) in pos.items():
        fill = "#f4a261" if node is attn else "#e9f1f7"
        label, shape = f"{node.name}: {_target(node)}", _shape(node).strip()
        # a box holds 28 characters; the whole text is the node's tooltip (<title>)
        out.append(f"<g><title>{html.escape(label)}\n{html.escape(shape)}</title>")
        out.append(f'<rect x="{x}" y="{y}" width="{box_w}" height="{box_h}" rx="5" '
                   f'fill="{fill}" stroke="#335"/>')
        out.append(f'<text x="{x + 6}" y="{y + 14}">{html.escape(_fit(label))}</text>')
        out.append(f'<text x="{x + 6}" y="{y + 27}" fill="#555">{html.escape(_fit(shape))}</text>')
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _fit(text: str, width: int = 28) -> str:
    return text if len(text) <= width else text[: width - 1] + "\u2026"

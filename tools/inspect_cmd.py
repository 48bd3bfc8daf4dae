"""`dualkv inspect`: trace a model through optimize() on CPU and show what each pass did."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import dualkv_compile as dk
from dualkv_compile.passes._common import Refusal
from dualkv_compile.testing import make_batch

from ._common import check_out_path
from .graph_text import attention_region_svg, graph_text
from . import models
from .models import CliError, build_model

__all__ = ["run_inspect"]

# the packed tokens inspect traces at most: its CPU run (the reference attention, the graph
# passes) grows with the square of a segment's length
MAX_TOKENS = 65536
SLOW_TOKENS = 8192  # from here on a trace takes seconds to minutes: say so before it starts
STAGES = {"traced": "graph traced by Dynamo (before the passes)",
          "checkpoint_inline": "after inlining the activation-checkpointed layers",
          "attention_rewrite": "after the attention rewrite",
          "token_locality": "after the token-locality proof (unchanged when proven)",
          "lm_head": "after the LM-head cut",
          "position_tables": "after storing the position tables (RoPE's cos/sin computed once)"}


def _heads(model) -> int:
    cfg = getattr(model, "config", None)
    return cfg.num_attention_heads if cfg is not None else model.layers[0].attn.num_heads


def _check_memory(model, name: str, tokens: int) -> None:
    """The CPU reference attention holds a [heads, T, T] float32 score matrix and its softmax:
    refused up front where they do not fit (it failed with an allocator traceback)."""
    need = 2 * _heads(model) * tokens ** 2 * 4
    available = models.available_memory()
    if available is not None and need > available:
        raise CliError(f"the CPU reference attention of {name} over {tokens:,} packed tokens "
                       f"holds {need / 2**30:.1f} GiB of scores, more than the "
                       f"{available / 2**30:.1f} GiB this machine has available: use fewer or "
                       "shorter groups")


def _head_dim(model) -> int | None:
    cfg = getattr(model, "config", None)
    if cfg is not None:  # transformers
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn = getattr(model.layers[0], "attn", None)
    return getattr(attn, "head_dim", None)


def _write(folder: Path, stages, refusal) -> None:
    """Each stage's graph as text, and the attention region's SVG when nothing was refused."""
    folder.mkdir(parents=True, exist_ok=True)
    # an earlier run's files would pass for this run's (a refused run writes fewer stages)
    for old in [*folder.glob("[0-9]_*.txt"), folder / "attention_region.svg"]:
        old.unlink(missing_ok=True)
    for i, (stage, text, gm) in enumerate(stages):
        (folder / f"{i}_{stage}.txt").write_text(text)
    if stages and refusal is None:
        (folder / "attention_region.svg").write_text(attention_region_svg(stages[-1][2]))


def run_inspect(args, out=print) -> int:
    if args.out is not None and not args.out.strip():  # (it wrote nothing, and said nothing)
        raise CliError(f"--out {args.out!r}: name a folder")
    folder = check_out_path(args.out, folder=True) if args.out is not None else None
    tokens = args.groups * (args.prompt_len + args.group_size * args.response_len)
    if tokens > MAX_TOKENS:
        raise CliError(f"the layout packs {tokens:,} tokens, more than inspect runs on the CPU "
                       f"({MAX_TOKENS:,}): use fewer or shorter groups")
    model = build_model(args.model, args.layers, positions=args.prompt_len + args.response_len)
    _check_memory(model, args.model, tokens)
    vocab = model.get_output_embeddings().weight.shape[0] if hasattr(
        model, "get_output_embeddings") else model.tok_embeddings.num_embeddings
    if args.groups > vocab - 2:  # make_batch tells groups apart by their first token, 1..G
        raise CliError(f"--groups {args.groups}: {args.model}'s vocabulary of {vocab} tokens "
                       f"holds distinct prompts for at most {vocab - 2} groups here")
    g = torch.Generator().manual_seed(0)
    tokens, mask, p = make_batch([args.prompt_len] * args.groups,
                                 [[args.response_len] * args.group_size] * args.groups,
                                 vocab=vocab, generator=g)
    packed = dk.pack(tokens, prompt_len=p, padding_mask=mask)
    # the flex kernels (auto, flash, triton) share one graph form: the CPU trace shows it, and
    # the lines below name the kernel a GPU would run
    asked = args.attention_backend
    from dualkv_compile.attention.registry import attention_kernel

    try:
        config = dk.DualKVConfig(backend="aot_eager", fallback="error",
                                 attention_backend="auto" if attention_kernel(asked).flex
                                 else asked)
        wrapper = dk.optimize(model, config)
    except (TypeError, ValueError) as e:
        raise CliError(f"optimize() rejects {args.model}: {e}") from None
    stages: list[tuple[str, str, object]] = []
    wrapper._observer = lambda stage, gm: stages.append((stage, graph_text(gm), gm))
    dk.counters.clear()
    refusal = None
    if packed.seq_len >= SLOW_TOKENS:  # (on stderr: stdout may be piped into a file)
        print(f"tracing {args.model} through optimize() on {packed.seq_len:,} packed tokens "
              "(the CPU reference attention runs too; this can take a minute)...",
              file=sys.stderr, flush=True)
    try:
        with torch.no_grad():
            wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    except Refusal as e:
        refusal = e
    if folder is not None:  # before printing: a reader that leaves early (| head) ends the run
        try:
            _write(folder, stages, refusal)
        except OSError as e:
            raise CliError(f"--out {args.out}: cannot write: {e}") from None
    out(f"model {args.model}: {type(model).__name__}; layout: {args.groups} group(s) x "
        f"{args.group_size} responses, prompt {args.prompt_len}, response {args.response_len}; "
        f"T={packed.seq_len}, rho={packed.rho:.2f}")
    from dualkv_compile.attention.selection import describe_attention_backend

    cpu = describe_attention_backend(torch.device("cpu"),
                                     requested="auto" if attention_kernel(asked).flex else asked)
    if attention_kernel(asked).flex and asked != "auto":  # the CPU traces every flex kernel alike
        cpu += f"; {asked!r} requested, a flex kernel, traced in its CPU form"
    out(f"attention kernel: {cpu}")
    if torch.cuda.is_available():
        head_dim = _head_dim(model)
        out(f"attention kernel on this GPU: "
            f"{describe_attention_backend(torch.device('cuda'), head_dim, torch.bfloat16, asked)}")
    for stage, text, _ in stages:
        out(f"\n== {STAGES[stage]} ({text.count(chr(10))} lines) ==")
        out(text.rstrip("\n"))
    out("\n== counters ==")
    for key in sorted(dk.counters):
        out(f"{key}: {dk.counters[key]}")
    if refusal is not None:
        out(f"\nrefused: {refusal}")
    if folder is not None:
        out(f"\nwrote {len(stages)} graph file(s)"
            + ("" if refusal is not None else " and attention_region.svg") + f" to {folder}")
    return 1 if refusal is not None else 0

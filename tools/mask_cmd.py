"""`dualkv mask`: draw the shared-prefix block mask of a layout as a PNG."""

from __future__ import annotations

import struct
import sys
import zlib
from pathlib import Path

import torch

import dualkv_compile as dk
from dualkv_compile.attention.block_mask import BLOCK_SIZE, block_classes
from dualkv_compile.attention.flash_causal import block_aligned
from dualkv_compile.testing import make_batch

from ._common import check_out_path
from .models import CliError

__all__ = ["run_mask", "write_png"]

_COLOURS = {0: (255, 255, 255), 1: (244, 162, 97), 2: (38, 70, 83)}  # empty, partial, full


def write_png(path: Path, pixels: torch.Tensor) -> None:
    """pixels [H, W, 3] uint8 -> an RGB PNG (zlib, no image library needed)."""
    h, w, _ = pixels.shape
    rows = b"".join(b"\x00" + bytes(pixels[i].flatten().tolist()) for i in range(h))

    def chunk(kind, data):
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b""))
    path.write_bytes(png)


# the drawing holds [blocks, blocks] classes and an image of that many pixels a side (at
# least); --scale may enlarge the image up to MAX_SIDE pixels a side (50 MB of RGB)
MAX_BLOCKS = 4096
SLOW_TOKENS = 65536  # from here on the classification takes many seconds: say so first
MAX_SIDE = 4096


def run_mask(args, out=print) -> int:
    path = check_out_path(args.out, folder=False)
    if path.suffix.lower() != ".png":
        raise CliError(f"--out {args.out!r}: the mask is drawn as a PNG; name a .png file")
    # the packed length: every group's prompt once and its responses, rounded up to --pad-to
    tokens_needed = args.groups * (args.prompt_len + args.group_size * args.response_len)
    padded = -(-tokens_needed // args.pad_to) * args.pad_to
    if padded > MAX_BLOCKS * BLOCK_SIZE:
        raise CliError(f"--groups {args.groups} --group-size {args.group_size} "
                       f"-P {args.prompt_len} -R {args.response_len} --pad-to {args.pad_to} "
                       f"packs {padded:,} tokens ({padded // BLOCK_SIZE:,} blocks a side); the "
                       f"mask drawing is bounded at {MAX_BLOCKS} blocks "
                       f"({MAX_BLOCKS * BLOCK_SIZE:,} tokens): draw fewer groups, shorter "
                       "sequences or a smaller --pad-to")
    g = torch.Generator().manual_seed(args.seed)
    if args.ragged:
        lengths = [[int(x) for x in torch.randint(0, args.response_len + 1, (args.group_size,),
                                                  generator=g)] for _ in range(args.groups)]
        out(f"response lengths drawn (seed {args.seed}):")
        for i, group in enumerate(lengths):
            out(f"  group {i}: {' '.join(map(str, group))}")
    else:
        lengths = [[args.response_len] * args.group_size for _ in range(args.groups)]
    tokens, mask, p = make_batch([args.prompt_len] * args.groups, lengths, generator=g,
                                 vocab=max(1000, args.groups + 2))  # (ids only tell groups apart)
    packed = dk.pack(tokens, prompt_len=p, padding_mask=mask, pad_to=args.pad_to)
    if packed.seq_len >= SLOW_TOKENS:  # (on stderr: stdout may be piped into a file)
        print(f"classifying the {packed.seq_len // BLOCK_SIZE:,} x {packed.seq_len // BLOCK_SIZE:,}"
              " blocks (this can take a minute)...", file=sys.stderr, flush=True)
    classes = block_classes(packed)  # [Qb, Kb]: 0 empty, 1 partial, 2 full
    nb = classes.shape[0]
    total = nb * nb
    full, partial = int((classes == 2).sum()), int((classes == 1).sum())
    scale = args.scale or max(1, min(16, 1024 // nb))
    if nb * scale > MAX_SIDE:
        raise CliError(f"--scale {scale}: {nb}x{nb} blocks of {scale} px make {nb * scale:,} px a "
                       f"side, more than the limit of {MAX_SIDE}: use --scale "
                       f"{max(1, MAX_SIDE // nb)} or less")
    colours = torch.tensor([_COLOURS[i] for i in range(3)], dtype=torch.uint8)
    pixels = colours[classes.long()].repeat_interleave(scale, 0).repeat_interleave(scale, 1)
    try:
        write_png(path, pixels)
    except OSError as e:
        raise CliError(f"--out {args.out}: cannot write: {e}") from None
    out(f"T={packed.seq_len} tokens, {nb}x{nb} blocks of {BLOCK_SIZE}; rho={packed.rho:.2f}, "
        f"ideal attention speed-up {packed.pair_reduction:.2f}x")
    out(f"full blocks: {full}, partial blocks: {partial}, empty blocks: {total - full - partial}")
    out(f"block sparsity: {(total - full - partial) / total:.1%} of blocks skipped")
    if block_aligned(packed):
        out("every block lies in one segment: eager FLASH calls of the op run FA4's causal "
            "form (longest-first); optimize()'s graphs run flex")
    else:
        out("some blocks hold two segments: FLASH runs flex's mask_mod form")
    out(f"wrote {path} ({nb * scale}x{nb * scale} px: dark = full, orange = partial, "
        f"white = skipped)")
    return 0

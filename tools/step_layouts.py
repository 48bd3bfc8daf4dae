"""The batches `bench step` times, and the useful FLOPs of each: one group per --shapes entry;
for --ragged, bench_ragged's seeded layout with its aligned twins."""

from __future__ import annotations

import torch

__all__ = ["layouts", "useful_flops"]


def useful_flops(model, packed, response_tokens: int) -> float:
    """The packed computation's FLOPs: every packed token through the layers, the packed
    causal pairs through attention, the LM head on the response tokens."""
    cfg = model.config
    d, v = cfg.hidden_size, cfg.vocab_size
    layer_params = sum(q.numel() for q in model.model.layers.parameters())
    pairs = packed.attention_pairs[1]
    attn = 12 * cfg.head_dim * cfg.num_attention_heads * pairs * cfg.num_hidden_layers
    return 6 * layer_params * packed.num_tokens + attn + 6 * v * d * response_tokens


def layouts(args):
    """((N, P label, R label), tokens, padding_mask, prompt_len) on the CPU: one group per
    --shapes entry, then for each --ragged case (bench_ragged's seeded layouts) the ragged
    micro-batch, an aligned one of as many groups and rows with every prompt and response at
    their mean length (about the same packed tokens), and that one in whole 128-token blocks."""
    from dualkv_compile.testing import make_batch
    from dualkv_compile.tools.bench_ragged import ragged_case

    g = torch.Generator().manual_seed(0)
    for n, p, r in args.shapes:
        prompt = torch.randint(1, args.vocab, (1, p), generator=g).expand(n, p)
        tokens = torch.cat([prompt, torch.randint(1, args.vocab, (n, r), generator=g)], 1)
        yield (n, p, r), tokens, torch.ones_like(tokens, dtype=torch.bool), p
    for case in args.ragged:
        p_cap, r_cap, seed = (int(x) for x in case.split(","))
        tokens, mask, p, n, prompts, responses = ragged_case(seed, p_cap, r_cap, args.max_tokens)
        tokens = tokens % (args.vocab - 1) + 1  # ragged_case draws ids for a 1000-token vocab
        groups = len(prompts)
        yield (n, f"ragged <= {p_cap}, {groups} groups", f"<= {r_cap}"), tokens, mask, p
        p_mean = round(sum(prompts) / groups)
        r_mean = round(sum(map(sum, responses)) / (groups * n))
        # the same means, then rounded to whole 128-token blocks (the tidy layout of #4)
        for p_twin, r_twin in ((p_mean, r_mean), (_blocks(p_mean), _blocks(r_mean))):
            tokens, mask, p = make_batch([p_twin] * groups, [[r_twin] * n] * groups,
                                         vocab=args.vocab - groups - 1, generator=g)
            yield (n, f"{p_twin} x {groups} groups", r_twin), tokens, mask, p


def _blocks(length: int, block: int = 128) -> int:
    return max(block, round(length / block) * block)

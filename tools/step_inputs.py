"""What `bench step` times: the model (Qwen3-8B- or Qwen3-30B-A3B-shaped), the batches (one
group per --shapes entry; for --ragged, bench_ragged's seeded layout with its aligned twins)
and the useful FLOPs of each."""

from __future__ import annotations

import torch

__all__ = ["build_model", "layouts", "useful_flops"]


def build_model(layers: int, vocab: int, family: str = "qwen3_8b"):
    """A Qwen3-8B-shaped decoder, or a Qwen3-30B-A3B-shaped MoE whose experts run as the
    grouped op (models.use_grouped_experts), with `layers` layers, bf16 on the GPU."""
    import transformers as tf

    if family == "qwen3_30b_a3b":
        from dualkv_compile.models import QWEN3_30B_A3B, qwen3_moe, use_grouped_experts

        with torch.device("cuda"):
            model = qwen3_moe(**{**QWEN3_30B_A3B, "num_layers": layers, "vocab_size": vocab})
        use_grouped_experts(model)
        return model.bfloat16().train()
    cfg = tf.Qwen3Config(vocab_size=vocab, hidden_size=4096, intermediate_size=12288,
                         num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, max_position_embeddings=40960, tie_word_embeddings=False)
    with torch.device("cuda"):
        model = tf.Qwen3ForCausalLM._from_config(cfg, attn_implementation="sdpa",
                                                 torch_dtype=torch.bfloat16)
    return model.train()


def useful_flops(model, packed) -> float:
    """Forward + backward (three forwards) of the packed computation: rl.flops' count (every
    packed token through the layers' matmuls, a token's active experts only; the packed causal
    pairs through attention; the LM head at the response tokens)."""
    from dualkv_compile.rl.flops import forward_flops

    return 3.0 * forward_flops(model, packed)


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
    for p_cap, r_cap, seed in args.ragged:  # parsed by _common.parse_ragged_case
        tokens, mask, p, n, prompts, responses = ragged_case(seed, p_cap, r_cap, args.max_tokens)
        tokens = tokens % (args.vocab - 1) + 1  # ragged_case draws ids for a 1000-token vocab
        groups = len(prompts)
        yield (n, f"ragged <= {p_cap}, {groups} groups, seed {seed}", f"<= {r_cap}"), tokens, mask, p
        p_mean = round(sum(prompts) / groups)
        r_mean = round(sum(map(sum, responses)) / (groups * n))
        # the same means, then rounded to whole 128-token blocks (the tidy layout of #4)
        for p_twin, r_twin in ((p_mean, r_mean), (_blocks(p_mean), _blocks(r_mean))):
            tokens, mask, p = make_batch([p_twin] * groups, [[r_twin] * n] * groups,
                                         vocab=args.vocab - groups - 1, generator=g)
            yield (n, f"{p_twin} x {groups} groups", r_twin), tokens, mask, p


def _blocks(length: int, block: int = 128) -> int:
    return max(block, round(length / block) * block)

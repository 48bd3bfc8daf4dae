"""Useful FLOPs (dualkv_compile.rl.flops) checked against torch's FlopCounterMode on the plain
forward of one row, which counts dense attention (the full square) and the LM head everywhere;
and on two rows sharing a prompt, whose packed tokens and pairs count the prompt once."""

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from dualkv_compile import pack
from dualkv_compile.models import qwen3
from dualkv_compile.rl import forward_flops, peak_bf16_tflops, policy_update_flops


def test_forward_flops_match_the_counted_dense_forward():
    torch.manual_seed(0)
    model = qwen3(vocab_size=97, num_layers=3, num_heads=4, num_kv_heads=2, embed_dim=64,
                  intermediate_dim=96, head_dim=16)
    p, r = 11, 5
    tokens = torch.randint(1, 97, (1, p + r))
    # the math backend runs attention as matmuls, which the counter counts (it has no formula
    # for the CPU flash kernel)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens)
    dense = counter.get_total_flops()
    heads, head_dim, vocab, dim, layers = 4, 16, 97, 64, 3
    length = p + r
    # our count: attention only over causal pairs (diagonal included), LM head at the response
    masked_pairs = length * length - length * (length + 1) // 2
    expected = dense - 4 * heads * head_dim * masked_pairs * layers - 2 * vocab * dim * p
    packed = pack(tokens, prompt_len=p)
    assert forward_flops(model, packed) == expected
    assert policy_update_flops(model, packed) == 5 * expected


def test_peak_is_unknown_off_the_gpu():
    assert peak_bf16_tflops(torch.device("cpu")) is None


def test_moe_flops_count_a_tokens_active_experts():
    """Qwen3-MoE: attention and router as in a dense model, the expert GEMMs at top-k of E."""
    from dualkv_compile.models import qwen3_moe

    model = qwen3_moe(vocab_size=97, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32,
                      head_dim=8, moe_intermediate_dim=16, num_experts=8, experts_per_token=2)
    p, r = 11, 5
    packed = pack(torch.randint(1, 97, (1, p + r)), prompt_len=p)
    d, heads, hd, kv, e, k, inter, layers = 32, 4, 8, 2, 8, 2, 16, 2
    per_layer = (d * heads * hd * 2 + d * kv * hd * 2  # q, o and k, v projections
                 + e * d                               # the router
                 + k * 3 * d * inter)                  # gate, up, down of the k active experts
    length = p + r
    pairs = length * (length + 1) // 2
    expected = (2 * per_layer * layers * length + 4 * heads * hd * pairs * layers
                + 2 * 97 * d * r)
    assert forward_flops(model, packed) == expected


def test_forward_flops_count_a_shared_prompt_once():
    torch.manual_seed(0)
    heads, head_dim, vocab, dim, layers = 4, 16, 97, 64, 3
    model = qwen3(vocab_size=vocab, num_layers=layers, num_heads=heads, num_kv_heads=2,
                  embed_dim=dim, intermediate_dim=96, head_dim=head_dim)
    # per-token matmul FLOPs of the layers, from a counted one-token forward
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(torch.randint(1, vocab, (1, 1)))
    per_token = counter.get_total_flops() - 4 * heads * head_dim * layers - 2 * vocab * dim
    p, r1, r2 = 11, 5, 3
    prompt = torch.randint(1, vocab, (1, p))
    tokens = torch.cat([prompt.expand(2, -1), torch.randint(1, vocab, (2, r1))], 1)
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[1, p + r2:] = False
    packed = pack(tokens, prompt_len=p, padding_mask=mask)
    pairs = p * (p + 1) // 2 + sum(p * r + r * (r + 1) // 2 for r in (r1, r2))
    expected = (per_token * (p + r1 + r2) + 4 * heads * head_dim * pairs * layers
                + 2 * vocab * dim * (r1 + r2))
    assert forward_flops(model, packed) == expected

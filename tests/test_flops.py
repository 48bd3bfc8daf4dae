"""Useful FLOPs (dualkv_compile.rl.flops) checked against torch's FlopCounterMode on the plain
forward of one row, which counts dense attention (the full square) and the LM head everywhere."""

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

"""The attention-kernel registry: every kernel DualKVConfig can name is declared there once, and
the checks that used to compare names ask it instead."""

import pytest
import torch

import dualkv_compile as dk
import dualkv_compile.attention.op  # noqa: F401  (registers the region ops)
from dualkv_compile.attention.registry import FLEX_KERNELS, KERNELS, attention_kernel
from dualkv_compile.attention.sdpa_segments import sdpa_shared_prefix_attention
from dualkv_compile.testing import make_batch, tiny_model


def test_every_kernel_is_a_config_choice_and_says_why_it_is_kept():
    assert set(KERNELS) == {"auto", "flash", "triton", "regions", "flash_regions"}
    for name, kernel in KERNELS.items():
        assert dk.DualKVConfig(attention_backend=name).attention_backend == name
        assert kernel.kept_because
    with pytest.raises(ValueError, match="'cudnn' is not one of .*'flash_regions'"):
        attention_kernel("cudnn")


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_options_only_for_flex_kernels(name):
    if name in FLEX_KERNELS:
        config = dk.DualKVConfig(attention_backend=name, kernel_options={"BLOCK_M": 64})
        assert config.kernel_options == {"BLOCK_M": 64}
    else:
        with pytest.raises(ValueError, match=f"attention_backend='{name}' does not use it"):
            dk.DualKVConfig(attention_backend=name, kernel_options={"BLOCK_M": 64})


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_region_kernels_run_their_op_and_flex_kernels_have_none(name):
    # the op a region kernel names computes the shared-prefix attention (CPU, float64)
    kernel = attention_kernel(name)
    if kernel.flex:
        with pytest.raises(ValueError, match="flex kernel"):
            kernel.graph_op()
        return
    g = torch.Generator().manual_seed(0)
    tokens, mask, p = make_batch([5, 2], [[3, 0, 4], [6]], vocab=50, generator=g)
    packed = dk.pack(tokens, prompt_len=p, padding_mask=mask)
    q, k, v = (torch.randn(1, h, packed.seq_len, 8, generator=g, dtype=torch.float64)
               for h in (4, 2, 2))
    out = kernel.graph_op()(q, k, v, packed.segment_ids[0], packed.prefix_segment_ids[0],
                            8 ** -0.5)[0]
    want = sdpa_shared_prefix_attention(q, k, v, packed, scale=8 ** -0.5)
    valid = torch.ones(packed.seq_len, dtype=torch.bool)
    valid[slice(*packed.padding_span)] = False  # padding positions are unspecified
    assert (out - want)[..., valid, :].abs().max() < 1e-12


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_cuda_only_kernels_are_refused_for_a_cpu_model(name):
    config = dk.DualKVConfig(attention_backend=name)
    if attention_kernel(name).cuda_only:
        with pytest.raises(ValueError, match="is a CUDA kernel"):
            dk.optimize(tiny_model("qwen2_5"), config)
    else:
        assert dk.optimize(tiny_model("qwen2_5"), config).uses_dualkv

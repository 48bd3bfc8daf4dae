"""The attention-kernel registry: every kernel DualKVConfig can name is declared there once, and
the checks that used to compare names ask it instead."""

import pytest
import torch

import dualkv_compile as dk
from dualkv_compile.attention.registry import FLEX_KERNELS, KERNELS, attention_kernel
from dualkv_compile.testing import tiny_model


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
        assert dk.DualKVConfig(attention_backend=name, kernel_options={"BLOCK_M": 64})
    else:
        with pytest.raises(ValueError, match=f"attention_backend='{name}' does not use it"):
            dk.DualKVConfig(attention_backend=name, kernel_options={"BLOCK_M": 64})


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_region_kernels_run_their_registered_op_and_flex_kernels_have_none(name):
    kernel = attention_kernel(name)
    if kernel.flex:
        with pytest.raises(ValueError, match="flex kernel"):
            kernel.graph_op()
    else:
        assert kernel.graph_op() is getattr(torch.ops.dualkv, f"{name}_attention")


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_cuda_only_kernels_are_refused_for_a_cpu_model(name):
    config = dk.DualKVConfig(attention_backend=name)
    if attention_kernel(name).cuda_only:
        with pytest.raises(ValueError, match="is a CUDA kernel"):
            dk.optimize(tiny_model("qwen2_5"), config)
    else:
        assert dk.optimize(tiny_model("qwen2_5"), config).uses_dualkv

import pytest
import torch

from dualkv_compile.kernel_options import (
    KERNEL_OPTIONS_BY_ARCH,
    kernel_options_for,
    validate_kernel_options,
)


@pytest.mark.parametrize("arch", sorted(KERNEL_OPTIONS_BY_ARCH))
def test_every_table_entry_is_valid(arch):
    assert validate_kernel_options(KERNEL_OPTIONS_BY_ARCH[arch]) == KERNEL_OPTIONS_BY_ARCH[arch]


def test_good_options_pass_through():
    opts = {"BLOCK_M": 64, "fwd_num_warps": 8, "bwd_BLOCK_M1": 32, "BLOCK_N1": 64,
            "USE_TMA": True, "BACKEND": "TRITON"}
    assert validate_kernel_options(opts) == opts


@pytest.mark.parametrize("opts,message", [
    ({"BLOCK_MM": 64}, "unknown kernel option 'BLOCK_MM'"),
    ({"fwd_BLOK_M": 64}, "unknown kernel option 'fwd_BLOK_M'"),
    ({"BLOCK_M": 48}, "BLOCK_M=48 must be a power of two"),
    ({"BLOCK_N": 256}, "BLOCK_N=256 must divide the block size 128"),
    ({"num_warps": 3}, "num_warps=3 must be one of"),
    ({"USE_TMA": 1}, "USE_TMA=1 must be a bool"),
    ({"BLOCK_M": True}, "must be a positive int"),
    ({"BACKEND": "CUTE"}, "BACKEND='CUTE' is not one of"),
    ({"BLOCK_M1": 64, "BLOCK_N1": 32}, "BLOCK_N1=32 must be a multiple of BLOCK_M1=64"),
    ({"BLOCK_M2": 32, "BLOCK_N2": 64}, "BLOCK_M2=32 must be a multiple of BLOCK_N2=64"),
])
def test_bad_options_raise_naming_the_value(opts, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_kernel_options(opts)


def test_cpu_device_has_no_table_entry_but_overrides_are_validated():
    assert kernel_options_for(torch.device("cpu")) == {}
    with pytest.raises(ValueError, match="unknown kernel option"):
        kernel_options_for(torch.device("cpu"), {"nope": 1})

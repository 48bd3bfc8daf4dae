import pytest
import torch

from dualkv_compile.attention import selection
from dualkv_compile.attention.kernel_options import (
    TRITON_OPTIONS_BY_ARCH,
    kernel_options_for,
    validate_kernel_options,
)

def test_every_table_entry_is_valid():
    assert (9, 0) in TRITON_OPTIONS_BY_ARCH
    for table in TRITON_OPTIONS_BY_ARCH.values():
        for (head_dim, gqa), entry in table.items():
            assert validate_kernel_options(entry) == entry and "BACKEND" not in entry
            assert head_dim in (64, 128, 256) and gqa in (1, 4, 8)


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


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device of a chosen architecture, with or without flash-attn-4, on the CPU."""
    def make(capability, flash_installed, name="NVIDIA H100 80GB HBM3"):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        real_find_spec = selection.importlib.util.find_spec
        monkeypatch.setattr(selection.importlib.util, "find_spec",
                            lambda name: (object() if flash_installed else None)
                            if name == "flash_attn.cute" else real_find_spec(name))
        selection._resolve.cache_clear()
        return torch.device("cuda", 0)
    yield make
    selection._resolve.cache_clear()


def test_auto_takes_flash_where_it_imports_on_hopper(fake_gpu):
    dev = fake_gpu((9, 0), True)
    assert kernel_options_for(dev, head_dim=128, gqa=4) == {"BACKEND": "FLASH"}


def test_other_head_dims_stay_on_triton_and_flash_refuses_them(fake_gpu):
    dev = fake_gpu((9, 0), True)
    assert kernel_options_for(dev, head_dim=16, gqa=1)["BACKEND"] == "TRITON"
    with pytest.raises(ValueError, match="head dim 16 is not one FLASH is used for"):
        kernel_options_for(dev, head_dim=16, gqa=1, attention_backend="flash")


def test_auto_falls_back_to_triton_with_a_logged_reason(fake_gpu, caplog):
    dev = fake_gpu((9, 0), False)
    with caplog.at_level("WARNING", logger="dualkv_compile.attention.selection"):
        opts = kernel_options_for(dev, head_dim=128, gqa=4)
        kernel_options_for(dev, head_dim=128, gqa=4)
    assert opts["BACKEND"] == "TRITON"
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1 and "flash-attn-4 is not installed" in logged[0]  # once


@pytest.mark.parametrize("installed,chosen", [(True, "FLASH"), (False, "TRITON")])
def test_auto_says_which_measurement_it_chose_by(fake_gpu, caplog, installed, chosen):
    dev = fake_gpu((9, 0), installed)
    with caplog.at_level("INFO", logger="dualkv_compile.attention.selection"):
        assert kernel_options_for(dev, head_dim=128, gqa=4)["BACKEND"] == chosen
    (line,) = [r.getMessage() for r in caplog.records]
    assert f"auto chose {chosen}" in line and "measured on NVIDIA H100 80GB HBM3" in line
    assert "docs/results/attention_ragged_h100.md" in line


def test_auto_on_a_gpu_without_measurements_says_so(fake_gpu, caplog):
    dev = fake_gpu((9, 0), True, name="NVIDIA GH200 480GB")
    with caplog.at_level("INFO", logger="dualkv_compile.attention.selection"):
        assert kernel_options_for(dev, head_dim=128, gqa=4)["BACKEND"] == "FLASH"
    (line,) = [r.getMessage() for r in caplog.records]
    assert "no measurements committed for NVIDIA GH200 480GB: by capability" in line


def test_triton_uses_the_tuned_entry_and_overrides_win(fake_gpu, monkeypatch):
    dev = fake_gpu((9, 0), True)
    monkeypatch.setitem(TRITON_OPTIONS_BY_ARCH, (9, 0), {(128, 4): {"BLOCK_M": 64}})
    assert kernel_options_for(dev, head_dim=128, gqa=4, attention_backend="triton") == {
        "BACKEND": "TRITON", "BLOCK_M": 64}
    assert kernel_options_for(dev, {"BLOCK_M": 32}, head_dim=128, gqa=4,
                              attention_backend="triton")["BLOCK_M"] == 32
    assert kernel_options_for(dev, head_dim=64, gqa=1, attention_backend="triton") == {
        "BACKEND": "TRITON"}  # no entry: Inductor's defaults


@pytest.mark.parametrize("capability,installed,reason", [
    ((8, 0), True, "this GPU is sm_80"), ((9, 0), False, "flash-attn-4 is not installed")])
def test_asking_for_flash_where_it_cannot_run_raises_with_the_reason(fake_gpu, capability,
                                                                     installed, reason):
    dev = fake_gpu(capability, installed)
    with pytest.raises(ValueError, match=reason):
        kernel_options_for(dev, attention_backend="flash")


def test_backend_chosen_twice_or_unknown_raises(fake_gpu):
    dev = fake_gpu((9, 0), True)
    with pytest.raises(ValueError, match="both choose the kernel"):
        kernel_options_for(dev, {"BACKEND": "TRITON"}, attention_backend="flash")
    with pytest.raises(ValueError, match="attention_backend='cute' is not one of"):
        kernel_options_for(dev, attention_backend="cute")


def test_a_backend_in_kernel_options_gets_the_same_checks(fake_gpu):
    dev = fake_gpu((9, 0), True)
    with pytest.raises(ValueError, match="head dim 16"):  # FA4 gave a wrong dq there
        kernel_options_for(dev, {"BACKEND": "FLASH"}, head_dim=16, gqa=1)
    assert kernel_options_for(dev, {"BACKEND": "TRITON"}, head_dim=128, gqa=4) == {
        "BACKEND": "TRITON"}


def test_fp32_stays_on_triton_and_flash_on_cpu_raises(fake_gpu):
    dev = fake_gpu((9, 0), True)
    assert kernel_options_for(dev, head_dim=128, gqa=4, dtype=torch.float32)["BACKEND"] == "TRITON"
    assert kernel_options_for(dev, head_dim=128, gqa=4, dtype=torch.bfloat16)["BACKEND"] == "FLASH"
    with pytest.raises(ValueError, match="is a CUDA kernel"):
        kernel_options_for(torch.device("cpu"), attention_backend="flash")


def test_the_cli_line_names_the_kernel_and_the_reason(fake_gpu):
    from dualkv_compile.attention.selection import describe_attention_backend

    dev = fake_gpu((9, 0), False)
    line = describe_attention_backend(dev, 128, torch.bfloat16)
    assert line.startswith("TRITON on cuda:0") and "flash-attn-4 is not installed" in line
    assert describe_attention_backend(torch.device("cpu")).startswith("CPU reference")
    assert describe_attention_backend(dev, 128, torch.bfloat16, "regions").startswith(
        "REGIONS on cuda:0 (requested 'regions'; cuDNN")
    assert "cuDNN computes in bf16/fp16, not torch.float32" in describe_attention_backend(
        dev, 128, torch.float32, "regions")

"""FLASH's causal form (flash_causal.py) rests on one claim: on a layout whose every 128-token
block lies in one segment, "causal AND the BlockMask's listed blocks" is the shared-prefix
mask. Checked here on CPU against the dense mask, together with the cases where it fails (and
the form must not be used). The kernel itself runs on GPU only (tests/gpu/test_attention_gpu.py)."""

import pytest
import torch

from dualkv_compile import pack
from dualkv_compile.attention.block_mask import BLOCK_SIZE, block_classes, dense_mask
from dualkv_compile.attention.flash_causal import block_aligned, flash_causal_attention
from dualkv_compile.testing import make_batch, random_qkv


def causal_and_listed_blocks(pb):
    listed = (block_classes(pb) > 0).repeat_interleave(BLOCK_SIZE, 0)
    listed = listed.repeat_interleave(BLOCK_SIZE, 1)
    t = pb.seq_len
    return torch.ones(t, t, dtype=torch.bool).tril() & listed


def packed(prompts, responses, pad_to=128, shuffle=False):
    tokens, mask, p = make_batch(prompts, responses, shuffle=shuffle,
                                 generator=torch.Generator().manual_seed(0))
    return pack(tokens, prompt_len=p, padding_mask=mask, pad_to=pad_to)


ALIGNED = [([256], [[128] * 3]), ([128, 384], [[256, 128], [128] * 4]),
           ([512], [[128, 384, 256]])]
RAGGED = [([200], [[100] * 3]), ([256], [[64] * 4]), ([256], [[128, 100]]),
          ([128, 100], [[128], [128]])]


@pytest.mark.parametrize("prompts,responses", ALIGNED)
def test_causal_and_listed_blocks_is_the_mask_on_aligned_layouts(prompts, responses):
    pb = packed(prompts, responses, shuffle=True)
    assert block_aligned(pb)
    assert torch.equal(causal_and_listed_blocks(pb), dense_mask(pb))


@pytest.mark.parametrize("prompts,responses", RAGGED)
def test_ragged_layouts_are_not_aligned_and_the_claim_fails_there(prompts, responses):
    pb = packed(prompts, responses)
    assert not block_aligned(pb)
    # causal AND listed blocks lets some query see a key of another segment
    assert not torch.equal(causal_and_listed_blocks(pb), dense_mask(pb))


def test_whole_padding_blocks_keep_a_layout_aligned():
    pb = packed([256], [[128] * 2], pad_to=1024)  # 512 valid tokens, 512 of padding
    assert pb.seq_len == 1024 and block_aligned(pb)
    assert torch.equal(causal_and_listed_blocks(pb), dense_mask(pb))


def test_a_length_of_partial_blocks_is_not_aligned():
    pb = packed([256], [[128] * 2], pad_to=64)  # 512 tokens: whole blocks, aligned
    assert block_aligned(pb)
    pb = packed([256], [[100] * 2], pad_to=8)  # 456 tokens: the last block is cut
    assert pb.seq_len % BLOCK_SIZE and not block_aligned(pb)


def test_the_causal_form_refuses_a_ragged_layout_before_any_kernel():
    pb = packed([200], [[100] * 3])
    q, k, v, _ = random_qkv(pb, 4, 2, 64, dtype=torch.float32, device="cpu",
                            generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="blocks .*hold two"):
        flash_causal_attention(q, k, v, pb)


@pytest.fixture
def flash_on_sm(monkeypatch):
    """_causal_form's GPU queries answered as on an sm_`major` machine where FLASH resolves."""
    import dualkv_compile.attention.op as attention

    def on(major):
        monkeypatch.setattr(attention, "resolve_attention_backend",
                            lambda requested, *a: "FLASH" if requested != "triton" else "TRITON")
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
        return attention._causal_form
    return on


def test_the_causal_form_is_taken_only_where_it_was_measured_and_is_exact(flash_on_sm,
                                                                          monkeypatch):
    aligned, ragged = packed([256], [[128] * 3]), packed([200], [[100] * 3])
    q = k = torch.zeros(1, 4, aligned.seq_len, 64)
    causal_form = flash_on_sm(9)
    assert causal_form(q, k, aligned, None, "flash")
    assert causal_form(q, k, aligned, None, "auto")
    assert not causal_form(q, k, aligned, None, "triton")
    assert not causal_form(q, k, ragged, None, "flash")
    assert not causal_form(q, k, aligned, {"BLOCK_M": 64}, "flash")
    torch.use_deterministic_algorithms(True)
    try:
        assert not causal_form(q, k, aligned, None, "flash")
    finally:
        torch.use_deterministic_algorithms(False)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not causal_form(q, k, aligned, None, "flash")
    monkeypatch.undo()
    assert not flash_on_sm(10)(q, k, aligned, None, "flash")  # sm_100: not measured there

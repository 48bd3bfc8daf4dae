import torch

from dualkv_compile.lm_head.gather_rows import SharedRows, gather_rows
from dualkv_compile.testing import rel_err


def _layout():
    # 10 source rows; rows 2 and 7 are shared (gathered 3 and 2 times), the rest at most once
    src = torch.tensor([2, 0, 7, 2, 5, 2, 7, 9, 4])
    shared = SharedRows(rows=torch.tensor([2, 7, 3]), members=torch.tensor([0, 3, 5, 2, 6]),
                        slot=torch.tensor([0, 0, 0, 1, 1]))  # row 3: shared, gathered by none
    return src, shared


def test_gradient_matches_index_select():
    src, shared = _layout()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 6, dtype=torch.float64, generator=g, requires_grad=True)
    cot = torch.randn(9, 6, dtype=torch.float64, generator=g)
    out = gather_rows(x, src, shared)
    assert torch.equal(out, torch.stack([x[i] for i in src.tolist()]))
    (ours,) = torch.autograd.grad((out * cot).sum(), x)
    (ref,) = torch.autograd.grad((x.index_select(0, src) * cot).sum(), x)
    assert rel_err(ours, ref) < 1e-15
    assert (ours[[1, 3, 6, 8]] == 0).all()  # gathered by no one


def test_shared_rows_are_summed_wide_and_rounded_once():
    src, shared = _layout()
    x = torch.zeros(10, 64, dtype=torch.bfloat16, requires_grad=True)
    cot = (torch.randn(9, 64, generator=torch.Generator().manual_seed(1)) * 3).bfloat16()
    (ours,) = torch.autograd.grad((gather_rows(x, src, shared) * cot).sum(), x)
    assert torch.equal(ours[2], cot[[0, 3, 5]].float().sum(0).bfloat16())
    assert torch.equal(ours[7], cot[[2, 6]].float().sum(0).bfloat16())
    assert torch.equal(ours[[0, 5, 9, 4]], cot[[1, 4, 7, 8]])
    # adding in bf16, one rounding per addition, differs somewhere: the check above can fail
    twice = (cot[0] + cot[3]) + cot[5]
    assert not torch.equal(twice, cot[[0, 3, 5]].float().sum(0).bfloat16())

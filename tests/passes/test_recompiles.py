import pytest
import torch

from dualkv_compile.recompiles import bounded_recompiles


def test_hitting_the_limit_raises_with_advice_instead_of_running_eager():
    torch._dynamo.reset()
    fn = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    with bounded_recompiles(1, "the test function"):
        assert torch.equal(fn(torch.ones(3)), torch.full((3,), 2.0))
    with pytest.raises(RuntimeError, match=r"the test function was compiled for 1 shape classes.*pad_to"):
        with bounded_recompiles(1, "the test function"):
            fn(torch.ones(5))  # a second shape: one compile past the limit

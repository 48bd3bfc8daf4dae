import pytest
import torch

from dualkv_compile.recompiles import bounded_recompiles


def test_hitting_the_limit_raises_with_advice_instead_of_running_eager():
    torch._dynamo.reset()
    fn = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    with bounded_recompiles(1, "the test function"):
        assert torch.equal(fn(torch.ones(3)), torch.full((3,), 2.0))
    with pytest.raises(RuntimeError, match=r"the test function was compiled for 1 shape "
                                           r"classes already \(its recompile limit\).*pad_to"):
        with bounded_recompiles(1, "the test function"):
            fn(torch.ones(5))  # a second shape: one compile past the limit


def test_the_limit_over_all_objects_is_named_when_it_is_the_one_hit():
    # a function called with functions of distinct code guards on each one's id: the count per
    # object (limit 8) stays at 1, the count over all of them reaches accumulated (3) first
    torch._dynamo.reset()
    fn = torch.compile(lambda g, x: g(x), backend="eager", dynamic=False)
    with torch._dynamo.config.patch(accumulated_recompile_limit=3):
        with pytest.raises(RuntimeError, match=r"the test function was compiled 3 times over "
                                               r"all its objects .*accumulated_recompile_limit"):
            with bounded_recompiles(8, "the test function"):
                for _ in range(5):
                    fn(eval("lambda x: x * 2"), torch.ones(3))  # new code each time

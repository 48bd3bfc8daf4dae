"""rl.distributed's full state dicts (the recipe's checkpoints, one process here): saved before
the first optimizer step, they hold no optimizer state, and a resume from them takes the same
first update as the run that was never interrupted; saved after it, the same next update."""

import io

import torch

from dualkv_compile.rl import distributed as ddp


def _saved(model, optimizer):
    """full_state_dicts through torch.save and load, as a checkpoint (on the CPU the dicts
    share the live tensors)."""
    buffer = io.BytesIO()
    torch.save(ddp.full_state_dicts(model, optimizer), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _fresh():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).double()
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _update(model, optimizer, seed):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def test_a_state_saved_before_the_first_step_resumes_as_a_fresh_optimizer():
    # get_optimizer_state_dict made a state by stepping at lr 0: AdamW's count 1 was saved (and
    # set on the live optimizer), so the resumed run's first update was 0.74x the right one
    model, optimizer = _fresh()
    model_state, optim_state = _saved(model, optimizer)
    assert optim_state["state"] == {} and not optimizer.state
    want = _update(*_fresh(), seed=1)
    resumed = _fresh()
    ddp.load_full_state_dicts(*resumed, model_state, optim_state)
    got = _update(*resumed, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_state_saved_after_a_step_resumes_the_same_next_update():
    model, optimizer = _fresh()
    _update(model, optimizer, seed=1)
    model_state, optim_state = _saved(model, optimizer)
    assert int(optim_state["state"]["weight"]["step"]) == 1
    want = _update(model, optimizer, seed=2)
    resumed = _fresh()
    ddp.load_full_state_dicts(*resumed, model_state, optim_state)
    got = _update(*resumed, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(got, want))

"""K decode steps captured as one CUDA graph, replayed with the live weights.

Each captured step draws its noise from the caller's generator (registered with the graph, so
every replay advances it as eager calls would) and runs the compiled decode step. The graph
reads the parameters at the addresses they had at capture: optimizer steps update them in
place and are seen; a parameter moved to new storage (`model.to`, a state-dict load that
assigns, FSDP re-gathering) changes the fingerprint, and the engine recaptures.
"""

from __future__ import annotations

import torch

from .sampling import draw_noise

__all__ = ["StepGraph", "warm_up", "weights_fingerprint"]


def weights_fingerprint(model: torch.nn.Module) -> tuple:
    return tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))


class StepGraph:
    """`steps` decode steps of `step_fn` over `tensors` (the cache's), as one CUDA graph."""

    def __init__(self, step_fn, tensors: list, noise: torch.Tensor, steps: int,
                 generator: torch.Generator | None, pool):
        self.graph = torch.cuda.CUDAGraph()
        if generator is not None:
            self.graph.register_generator_state(generator)
        with torch.cuda.graph(self.graph, pool=pool):
            for _ in range(steps):
                draw_noise(noise, generator)
                step_fn(*tensors)

    def replay(self):
        self.graph.replay()


def warm_up(step_fn, cache) -> None:
    """Compile and autotune before capture (a capture must not compile): two steps on a side
    stream, over whatever the cache holds, each from step 0; the caller refills the cache."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            cache.step.zero_()
            step_fn(*cache.decode_tensors())
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()

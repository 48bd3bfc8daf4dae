"""Sampling without a host sync: temperature, top-k, top-p, then argmax(probs / q) with
q ~ Exp(1) drawn from the caller's generator (the exponential trick, torchtune's `sample`).

The ops up to top-k are torchtune's `generation.sample`, op for op, so that the engine draws
the same tokens as torchtune's generate for the same generator. Top-p (nucleus) keeps the
smallest set of most likely tokens whose probability reaches top_p, as vLLM and transformers
do (their rule, summed from the least likely up); the most likely token is always kept. No multinomial, nonzero or .item(): the step can be
captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from ..arguments import MIN_TEMPERATURE, as_index, as_real, integer_arg, temperature_arg

__all__ = ["MIN_TEMPERATURE", "SamplingParams", "draw_noise", "sample", "stop_ids", "stop_mask",
           "stop_table"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "temperature", temperature_arg(self.temperature))
        if self.top_k is not None:  # stored as an int: it is part of the compiled step's key
            object.__setattr__(self, "top_k", integer_arg("top_k", self.top_k, 1))
        if self.top_p is not None:
            top_p = as_real(self.top_p)
            if top_p is None or not 0 < top_p <= 1:
                raise ValueError(f"top_p={self.top_p!r} must be a number in (0, 1] or None")
            object.__setattr__(self, "top_p", top_p)



def draw_noise(noise: Tensor, generator: torch.Generator | None) -> Tensor:
    """Fill noise [rows, vocab] (float32, as torchtune's generate draws it, whatever the
    logits' dtype) with Exp(1) draws, in place."""
    return noise.exponential_(1, generator=generator)


def _top_p(logits: Tensor, top_p: float) -> Tensor:
    sorted_logits, order = torch.sort(logits, dim=-1)  # ascending
    # drop the least likely tokens while their mass together stays within 1 - top_p, summed
    # from the least likely up as transformers and vLLM do (a float32 sum from the top drifts
    # over a 150K vocabulary and cut the nucleus short at high top_p); keep the most likely
    drop_sorted = torch.softmax(sorted_logits, dim=-1).cumsum(-1) <= 1 - top_p
    drop_sorted[..., -1] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample(logits: Tensor, noise: Tensor, params: SamplingParams) -> Tensor:
    """logits [rows, vocab] (float32, float64 for a float64 model), noise [rows, vocab] ~ Exp(1)
    -> tokens [rows] (int64)."""
    logits = logits / params.temperature
    if params.top_k is not None:
        v, _ = torch.topk(logits, min(params.top_k, logits.size(-1)))
        pivot = v.select(-1, -1).unsqueeze(-1)
        logits = torch.where(logits < pivot, -float("Inf"), logits)
    if params.top_p is not None and params.top_p < 1:
        logits = _top_p(logits, params.top_p)
    probs = torch.nn.functional.softmax(logits, dim=-1)
    return torch.argmax(probs / noise, dim=-1)


def stop_ids(stop_tokens, vocab: int | None = None) -> tuple[int, ...]:
    """The ids that end a response, as a sorted tuple (empty: none) from None, one id, or
    several (a generation config's eos_token_id list; an empty one, as a tokenizer without
    stop tokens gives, is none); each checked against [0, vocab)."""
    if stop_tokens is None:
        return ()
    if isinstance(stop_tokens, Mapping):  # iterating one gives its keys: {7: "eos"} read as 7
        raise ValueError(f"stop_tokens={stop_tokens!r} is a {type(stop_tokens).__name__}, not a "
                         "token id or ids: pass the ids themselves (e.g. list(its keys) where "
                         "the ids are its keys)")
    if (as_index(stop_tokens) is not None or not hasattr(stop_tokens, "__iter__")
            or getattr(stop_tokens, "ndim", None) == 0):  # a 0-dim tensor or array: one value
        given = [stop_tokens]  # one id, or something that is not an id (refused below)
    else:  # several ids
        given = list(stop_tokens)
    ids = []
    for raw in given:
        i = as_index(raw)
        if i is None or i < 0 or (vocab is not None and i >= vocab):
            where = f"[0, {vocab})" if vocab is not None else "[0, vocab)"
            raise ValueError(f"stop_tokens={stop_tokens!r} is not a token id (or ids) in {where}")
        ids.append(i)
    return tuple(sorted(set(ids)))


def stop_mask(token: Tensor, stops: tuple[int, ...]) -> Tensor:
    """tokens (any shape) -> bool of that shape: the token is one of `stops` (none: all False).
    Eager; a compiled step indexes `stop_table` instead, which creates no tensor."""
    return torch.isin(token, torch.tensor(stops, dtype=token.dtype, device=token.device))


def stop_table(stops: tuple[int, ...], vocab: int, device) -> Tensor:
    """[vocab] bool, True at the stop ids: `table[token]` marks stopped rows in a captured step."""
    table = torch.zeros(vocab, dtype=torch.bool, device=device)
    table[list(stops)] = True
    return table

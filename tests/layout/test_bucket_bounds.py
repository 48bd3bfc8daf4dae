"""The documented bounds are inclusive: bucket_growth up to 4, prompt splits of exactly 16 keys."""

import torch

from dualkv_compile import pack
from dualkv_compile.layout.buckets import bucket_length, check_bucket_growth
from dualkv_compile.rollout.cache import prompt_splits


def test_bucket_growth_four_is_accepted():
    check_bucket_growth(4)
    check_bucket_growth(4.0)
    assert bucket_length(300, 128, 4) == 512
    tokens = torch.ones(1, 6, dtype=torch.long)
    assert pack(tokens, prompt_len=3, bucket_growth=4).seq_len == 128


def test_prompt_splits_may_be_exactly_sixteen_keys():
    assert prompt_splits(1, 1, 32) == 2
    assert prompt_splits(1, 8, 64) == 4

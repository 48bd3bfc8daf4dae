"""The documented bounds are inclusive: bucket_growth up to 4, prompt splits of exactly 16 keys."""

import numpy as np
import pytest
import torch

from dualkv_compile import pack
from dualkv_compile.layout.buckets import bucket_count, bucket_length, check_bucket_growth
from dualkv_compile.rollout.cache import prompt_splits


def test_bucket_growth_four_is_accepted():
    check_bucket_growth(4)
    check_bucket_growth(4.0)
    check_bucket_growth(np.float32(1.1))  # "must be a number in [1, 4]" before
    assert bucket_length(1000, 128, np.int64(2)) == bucket_length(1000, 128, 2)
    assert bucket_length(300, 128, 4) == 512
    tokens = torch.ones(1, 6, dtype=torch.long)
    assert pack(tokens, prompt_len=3, bucket_growth=4).seq_len == 128


def test_prompt_splits_may_be_exactly_sixteen_keys():
    assert prompt_splits(1, 1, 32) == 2
    assert prompt_splits(1, 8, 64) == 4


def test_bucket_helpers_refuse_a_bad_pad_to_or_range():
    # bucket_length(1000, -128) gave -128, pad_to=0 a ZeroDivisionError, 100.5 a float
    # length; bucket_count(100, min_tokens=5000) gave 1 (pack() checks its own pad_to)
    for pad_to in (-128, 0, 100.5, True):
        with pytest.raises(ValueError, match=rf"pad_to={pad_to!r} must be an integer >= 1"):
            bucket_length(1000, pad_to)
    with pytest.raises(ValueError, match=r"num_tokens=-1 must be an integer >= 0"):
        bucket_length(-1)
    with pytest.raises(ValueError, match="min_tokens=5000 exceeds max_tokens=100"):
        bucket_count(100, 128, 1.1, min_tokens=5000)
    assert bucket_length(1000, 128) == 1024 and bucket_count(1024, 128) == 8

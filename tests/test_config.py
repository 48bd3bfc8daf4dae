import pytest

from dualkv_compile import DualKVConfig


def test_json_round_trip():
    cfg = DualKVConfig(pad_to=256, kernel_options={"BLOCK_M": 64}, backend="aot_eager",
                       fallback="dense", logprob_chunk_size=7, activation_memory_budget=0.5)
    again = DualKVConfig.from_json(cfg.to_json())
    assert again == cfg
    assert DualKVConfig.from_json(DualKVConfig().to_json()) == DualKVConfig()


def test_numpy_numbers_are_taken_as_floats():
    # np.float32 was refused where np.float64 (a float subclass) was taken
    import json

    import numpy as np

    for budget in (np.float32(0.5), np.float64(0.5), 1):
        cfg = DualKVConfig(activation_memory_budget=budget)
        assert type(cfg.activation_memory_budget) is float and json.loads(cfg.to_json())


def test_frozen():
    with pytest.raises(Exception, match="cannot assign"):
        DualKVConfig().pad_to = 256


def test_kernel_options_are_copied():
    options = {"BLOCK_M": 64}
    cfg = DualKVConfig(kernel_options=options)
    options["BLOK_N"] = 32  # a typo added later, after validation, must not reach the config
    assert cfg.kernel_options == {"BLOCK_M": 64}


@pytest.mark.parametrize("kwargs,message", [
    ({"version": 2}, "version=2"),
    ({"enabled": 1}, "enabled=1 must be a bool"),
    ({"pad_to": 100}, "pad_to=100 must be an integer, a positive multiple of 128"),
    ({"bucket_growth": 0.9}, "bucket_growth=0.9 must be a number in"),
    ({"bucket_growth": True}, "bucket_growth=True must be a number in"),
    ({"backend": "tvm"}, "backend='tvm' is not one of"),
    ({"attention_backend": "cudnn"}, "attention_backend='cudnn' is not one of"),
    ({"fallback": "ignore"}, "fallback='ignore' is not one of"),
    ({"logprob_chunk_size": 0}, "logprob_chunk_size=0"),
    # bools were accepted as 1, and failed at the first call under another name
    ({"logprob_chunk_size": True}, "logprob_chunk_size=True must be a positive integer"),
    ({"version": True}, "version=True"),
    ({"version": 1.0}, "version=1.0"),
    # the backward's tile pairs under the bwd_ prefix the tuned tables use
    ({"kernel_options": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 32}},
     "bwd_BLOCK_N1=32 must be a multiple of bwd_BLOCK_M1=64"),
    ({"kernel_options": {"BLOCK_M1": 32, "bwd_BLOCK_M1": 64, "BLOCK_N1": 32}},
     "BLOCK_N1=32 must be a multiple of bwd_BLOCK_M1=64"),
    ({"kernel_options": {"bwd_BLOCK_M2": 32, "BLOCK_N2": 64}},
     "bwd_BLOCK_M2=32 must be a multiple of BLOCK_N2=64"),
    ({"activation_memory_budget": 0}, "activation_memory_budget=0 must be in"),
    ({"activation_memory_budget": 1.5}, "activation_memory_budget=1.5 must be in"),
    ({"kernel_options": {"BLOK_M": 64}}, "unknown kernel option 'BLOK_M'"),
    ({"attention_backend": "regions", "kernel_options": {"BLOCK_M": 64}},
     "attention_backend='regions' does not use it"),
])
def test_validation_names_the_bad_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DualKVConfig(**kwargs)


def test_integers_of_numpy_and_torch_are_ints():
    # numpy and tensor ints, which pack() takes, were refused as "not a positive multiple of
    # 128" although they were one; stored as ints (the config is JSON)
    import numpy as np
    import torch

    cfg = DualKVConfig(pad_to=np.int64(256), logprob_chunk_size=torch.tensor(7))
    assert (cfg.pad_to, cfg.logprob_chunk_size) == (256, 7)
    assert type(cfg.pad_to) is int and type(cfg.logprob_chunk_size) is int
    assert DualKVConfig.from_json(cfg.to_json()) == cfg


def test_unknown_json_fields_are_named():
    with pytest.raises(ValueError, match=r"unknown DualKVConfig fields \['colour'\]"):
        DualKVConfig.from_json('{"colour": "red"}')

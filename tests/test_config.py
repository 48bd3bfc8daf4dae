import pytest

from dualkv_compile import DualKVConfig


def test_json_round_trip():
    cfg = DualKVConfig(pad_to=256, kernel_options={"BLOCK_M": 64}, backend="aot_eager",
                       fallback="dense", logprob_chunk_size=7, activation_memory_budget=0.5)
    again = DualKVConfig.from_json(cfg.to_json())
    assert again == cfg
    assert DualKVConfig.from_json(DualKVConfig().to_json()) == DualKVConfig()


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
    ({"pad_to": 100}, "pad_to=100 must be a positive multiple of 128"),
    ({"bucket_growth": 0.9}, "bucket_growth=0.9 must be a number in"),
    ({"bucket_growth": True}, "bucket_growth=True must be a number in"),
    ({"backend": "tvm"}, "backend='tvm' is not one of"),
    ({"attention_backend": "cudnn"}, "attention_backend='cudnn' is not one of"),
    ({"fallback": "ignore"}, "fallback='ignore' is not one of"),
    ({"logprob_chunk_size": 0}, "logprob_chunk_size=0"),
    ({"activation_memory_budget": 0}, "activation_memory_budget=0 must be in"),
    ({"activation_memory_budget": 1.5}, "activation_memory_budget=1.5 must be in"),
    ({"kernel_options": {"BLOK_M": 64}}, "unknown kernel option 'BLOK_M'"),
    ({"attention_backend": "regions", "kernel_options": {"BLOCK_M": 64}},
     "attention_backend='regions' does not use it"),
])
def test_validation_names_the_bad_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DualKVConfig(**kwargs)


def test_unknown_json_fields_are_named():
    with pytest.raises(ValueError, match=r"unknown DualKVConfig fields \['colour'\]"):
        DualKVConfig.from_json('{"colour": "red"}')

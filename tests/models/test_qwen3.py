"""Our Qwen3 (torchtune modules) against transformers' Qwen3ForCausalLM on random weights."""

import json

import pytest
import torch

import dualkv_compile as dk
from dualkv_compile.models import (
    load_hf_checkpoint,
    qwen3,
    qwen3_from_hf_config,
    qwen3_tiny,
    save_hf_checkpoint,
)
from dualkv_compile.testing import make_batch, rel_err, row_by_row_response_logprobs

import transformers as tf  # noqa: E402  (a test dependency: fail loudly if it is missing)


def hf_model(tied: bool, seed: int = 0):
    torch.manual_seed(seed)
    cfg = tf.Qwen3Config(vocab_size=97, hidden_size=48, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=256, rope_theta=10000.0,
                         rms_norm_eps=1e-6, tie_word_embeddings=tied)
    model = tf.Qwen3ForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():  # norms start at 1 in transformers: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_logits_equal_transformers(tmp_path, tied):
    hf = hf_model(tied)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = qwen3_from_hf_config(tmp_path)
    load_hf_checkpoint(ours, tmp_path)
    ours.eval()
    tokens = torch.randint(0, 97, (3, 21))
    pos = torch.arange(21)[None].expand(3, -1)
    with torch.no_grad():
        ref = hf(input_ids=tokens, position_ids=pos, use_cache=False).logits
        got = ours(tokens, input_pos=pos)
    assert rel_err(got, ref) < 1e-5
    assert hasattr(ours.output, "tied_module") == tied


def test_norm_before_rope_is_what_makes_it_qwen3(tmp_path):
    # torchtune's own MultiHeadAttention (norm after RoPE) on the same weights differs
    from torchtune.modules import MultiHeadAttention

    hf = hf_model(tied=True, seed=3)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = qwen3_from_hf_config(tmp_path)
    load_hf_checkpoint(ours, tmp_path)
    tokens = torch.randint(0, 97, (1, 12))
    pos = torch.arange(12)[None]
    with torch.no_grad():
        right = ours.eval()(tokens, input_pos=pos)
        for layer in ours.layers:
            layer.attn.forward = MultiHeadAttention.forward.__get__(layer.attn)
        wrong = ours(tokens, input_pos=pos)
    assert rel_err(wrong, right) > 1e-3


def test_save_round_trip_loads_in_transformers(tmp_path):
    ours = qwen3_tiny(vocab_size=64)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 64,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": True, "torch_dtype": "float32"}
    save_hf_checkpoint(ours, tmp_path, config=config)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3"
    hf = tf.Qwen3ForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    tokens = torch.randint(0, 64, (2, 17))
    pos = torch.arange(17)[None].expand(2, -1)
    with torch.no_grad():
        assert rel_err(ours.eval()(tokens, input_pos=pos),
                       hf(input_ids=tokens, position_ids=pos).logits) < 1e-5


def test_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_hf_checkpoint(qwen3_tiny(vocab_size=64), tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{}")  # a bare KeyError before
    with pytest.raises(ValueError, match="has no weight_map"):
        load_hf_checkpoint(qwen3_tiny(vocab_size=64), tmp_path)


@pytest.mark.parametrize("said", [{}, {"tie_word_embeddings": False}])
def test_a_config_that_misstates_the_tying_is_refused(tmp_path, said):
    # a tied model saved with a config saying untied (Qwen3Config's default when left out):
    # transformers loaded it with a random LM head, logits 0.7 off
    with pytest.raises(ValueError, match=r"tie_word_embeddings=False.* the model ties"):
        save_hf_checkpoint(qwen3_tiny(vocab_size=64), tmp_path,
                           config={"model_type": "qwen3"} | said)
    assert not list(tmp_path.iterdir())


def test_an_untied_checkpoint_is_refused_by_a_tied_model(tmp_path):
    hf_model(tied=False).save_pretrained(tmp_path, safe_serialization=True)
    tied = qwen3_from_hf_config(tmp_path, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="lm_head.weight differs .* tie_word_embeddings=False"):
        load_hf_checkpoint(tied, tmp_path)  # it once dropped the trained head without a word


@pytest.mark.parametrize("changes,message", [
    ({"model_type": "qwen3_moe"}, "model_type='qwen3_moe'.*qwen3_moe_from_hf_config"),
    ({"use_sliding_window": True, "sliding_window": 4, "layer_types": None,
      "max_window_layers": 1},
     "sliding-window attention"),
    ({"layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": True,
      "sliding_window": 4}, "sliding-window attention"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    # built without biases, then a KeyError on their weights; dropout dropped silently; a
    # bare KeyError
    ({"attention_bias": True}, "attention_bias=true"),
    ({"attention_dropout": 0.5}, "attention_dropout=0.5"),
    ({"num_key_value_heads": None}, r"lacks \['num_key_value_heads'\]"),
])
def test_config_fields_the_builder_cannot_honour_are_named(tmp_path, changes, message):
    hf_model(tied=False).config.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text()) | changes
    path.write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    with pytest.raises(ValueError, match=message):
        qwen3_from_hf_config(tmp_path)


def test_qwen3_through_optimize():
    torch.manual_seed(0)
    model = qwen3_tiny(vocab_size=64).double()
    tokens, mask, p = make_batch([7, 3], [[4, 0, 6], [5, 5]], shuffle=True, vocab=60,
                                 generator=torch.Generator().manual_seed(1))
    lp = dk.optimize(model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    ref = row_by_row_response_logprobs(model, tokens, mask, p)
    assert rel_err(lp.detach(), ref.detach()) < 1e-5  # the model's norms compute in float32


def test_random_weights_are_drawn_as_transformers_draws_them():
    """N(0, 0.02) projections and embeddings: sampling a random tied model gives varied tokens.
    (With PyTorch's N(0, 1) embedding the input token got probability 1.0, every sample of a
    GRPO group was the same and the advantages were all 0.)"""
    torch.manual_seed(0)
    model = qwen3(vocab_size=500, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=128,
                  intermediate_dim=256, head_dim=32, tie_word_embeddings=True).eval()
    stds = {name: float(p.std()) for name, p in model.named_parameters() if p.dim() == 2}
    assert all(abs(s - 0.02) < 0.004 for s in stds.values()), stds
    tokens = torch.randint(0, 500, (4, 32))
    with torch.no_grad():
        probs = model(tokens).float().softmax(-1)
    assert probs.max() < 0.1  # close to uniform (1/500), nowhere near one certain token


def test_a_context_config_json_leaves_out_is_transformers_default(tmp_path):
    # it was 40960; transformers' Qwen3Config builds 32768
    hf_model(tied=False).config.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    del cfg["max_position_embeddings"]
    path.write_text(json.dumps(cfg))
    assert qwen3_from_hf_config(tmp_path).max_seq_len == 32768


def test_pad_token_id_is_the_embeddings_padding_idx_as_in_transformers(tmp_path):
    # it was ignored: the pad row's embedding gradient was 5.3e4 where transformers' is 0
    torch.manual_seed(0)
    cfg = tf.Qwen3Config(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                         pad_token_id=5, tie_word_embeddings=False)
    hf = tf.Qwen3ForCausalLM._from_config(cfg, attn_implementation="sdpa").double()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = qwen3_from_hf_config(tmp_path)
    load_hf_checkpoint(ours, tmp_path)
    ours = ours.double()
    tokens, pos = torch.tensor([[1, 5, 7, 5, 9, 11, 5, 3]]), torch.arange(8)[None]
    hf(input_ids=tokens, position_ids=pos).logits.pow(2).sum().backward()
    ours(tokens, input_pos=pos).pow(2).sum().backward()
    theirs, got = hf.model.embed_tokens.weight.grad, ours.tok_embeddings.weight.grad
    assert got[5].abs().max() == 0 and theirs[5].abs().max() == 0
    assert rel_err(got, theirs) < 1e-5 and got[7].abs().max() > 0
    with pytest.raises(ValueError, match=r"pad_token_id=97 must be an id in \[0, 97\)"):
        qwen3_from_hf_config(tmp_path, pad_token_id=97)


@pytest.mark.parametrize("changes", [
    # transformers runs these with full attention: sliding layers without a window (the
    # post-init drops it unless use_sliding_window); each was refused as a window of None
    {"layer_types": ["full_attention", "sliding_attention"], "use_sliding_window": False},
    {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": None},
    {"hidden_act": "swish"}])  # transformers' ACT2FN["swish"] is nn.SiLU
def test_config_fields_transformers_reads_as_this_builder_builds_are_taken(tmp_path, changes):
    hf_model(tied=False).config.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))
    hf = tf.Qwen3ForCausalLM._from_config(tf.Qwen3Config.from_pretrained(tmp_path))
    assert all(layer.self_attn.sliding_window is None for layer in hf.model.layers)
    assert len(qwen3_from_hf_config(tmp_path).layers) == 2

"""Config and checkpoint edges where the builders and the checkpointer once differed from
transformers without a word: rope_scaling beside rope_parameters, fields left out of
config.json, a sharded checkpoint under a new single file, the saved config's dtype, a tied
Qwen3-MoE checkpoint whose head differs, a missing expert, the grouped expert op on no
tokens, the saved weights' fsync order and a failed save, and non-default RoPE theta, norm eps
and context read from the config."""

import json

import pytest
import torch

import transformers as tf  # noqa: E402  (a test dependency)
from dualkv_compile.models import (Qwen3HFCheckpointer, load_hf_checkpoint,
                                   qwen3_from_hf_config)
from dualkv_compile.models.hf_checkpoint import read_hf_state, write_hf_state
from dualkv_compile.testing import rel_err


def _dense_config(tmp_path, **changes):
    cfg = tf.Qwen3Config(vocab_size=97, hidden_size=48, intermediate_size=96,
                         num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=2,
                         head_dim=16).to_dict()
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_rope_scaling_beside_rope_parameters_is_read_first_and_refused(tmp_path):
    # transformers builds YaRN from rope_scaling even where rope_parameters says default
    path = _dense_config(tmp_path, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 32})
    with pytest.raises(ValueError, match="rope_type='yarn' is not supported"):
        qwen3_from_hf_config(path)


def test_fields_left_out_take_transformers_defaults(tmp_path):
    model = qwen3_from_hf_config(_dense_config(tmp_path, rope_parameters=None, rope_theta=None,
                                               head_dim=None))
    reference = tf.Qwen3Config.from_pretrained(tmp_path)
    attn = model.layers[0].attn
    assert attn.head_dim == reference.head_dim == 128
    assert attn.pos_embeddings.base == reference.rope_parameters["rope_theta"] == 10_000.0


def test_a_single_file_beside_a_sharded_checkpoint(tmp_path):
    old = {"model.norm.weight": torch.zeros(4)}
    new = {"model.norm.weight": torch.ones(4)}
    from safetensors.torch import save_file

    save_file(old, str(tmp_path / "shard-1.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "shard-1.safetensors"}}))
    with pytest.raises(FileExistsError, match="holds a sharded checkpoint"):
        write_hf_state(new, tmp_path, rename=False)
    save_file(new, str(tmp_path / "model.safetensors"))  # written by another tool
    assert torch.equal(read_hf_state(tmp_path)["model.norm.weight"], new["model.norm.weight"])


def test_the_saved_config_names_the_saved_dtype(tmp_path):
    source = tmp_path / "source"
    hf = tf.Qwen3ForCausalLM._from_config(tf.Qwen3Config(
        vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=6, num_key_value_heads=2, head_dim=16)).to(torch.bfloat16)
    hf.save_pretrained(source, safe_serialization=True)
    assert json.loads((source / "config.json").read_text())["dtype"] == "bfloat16"
    model = qwen3_from_hf_config(source).float()  # trained in fp32
    ck = Qwen3HFCheckpointer(str(source), str(tmp_path / "out"))
    folder = ck.save_checkpoint({"model": model.state_dict()}, epoch=1)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float32"
    again = tf.Qwen3ForCausalLM.from_pretrained(folder)
    assert again.dtype == torch.float32


def _saved_source(tmp_path):
    source = tmp_path / "source"
    tf.Qwen3ForCausalLM._from_config(tf.Qwen3Config(
        vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=6, num_key_value_heads=2, head_dim=16)).save_pretrained(
        source, safe_serialization=True)
    return source


def test_saved_weights_are_flushed_before_the_folder_takes_its_name(tmp_path, monkeypatch):
    import os
    from pathlib import Path

    source = _saved_source(tmp_path)
    synced, renamed = [], []
    real_fsync, real_rename = os.fsync, Path.rename
    monkeypatch.setattr(os, "fsync", lambda fd: (
        synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    monkeypatch.setattr(Path, "rename", lambda self, target: (
        renamed.append((self.name, len(synced))), real_rename(self, target))[1])
    ck = Qwen3HFCheckpointer(str(source), str(tmp_path / "out"))
    ck.save_checkpoint({"model": qwen3_from_hf_config(source).state_dict()}, epoch=1)
    (name, before), = [r for r in renamed if r[0] == "epoch_1.partial"]
    partial = str(tmp_path / "out" / "epoch_1.partial")
    assert {partial + "/model.safetensors", partial + "/config.json", partial} <= set(
        synced[:before])  # the files and the folder, before the rename
    assert str(tmp_path / "out") in synced[before:]  # its entry, after it


def test_a_failed_weights_save_leaves_no_partial_folder(tmp_path, monkeypatch):
    import dualkv_compile.models.checkpointer as checkpointer

    source = _saved_source(tmp_path)
    ck = Qwen3HFCheckpointer(str(source), str(tmp_path / "out"))

    def full_disk(state, directory, rename):
        (directory / "model.safetensors").parent.mkdir(parents=True, exist_ok=True)
        (directory / "model.safetensors").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpointer, "write_hf_state", full_disk)
    with pytest.raises(OSError, match=r"epoch_1 could not be written \(OSError: .*No space left "
                                      r"on device\); [0-9.]+ GiB free on its disk"):
        ck.save_checkpoint({"model": qwen3_from_hf_config(source).state_dict()}, epoch=1)
    assert not list((tmp_path / "out").iterdir())


def test_a_crash_between_the_renames_then_a_failed_save_keeps_the_previous_copy(
        tmp_path, monkeypatch):
    # the crash left epoch_1.replaced (the previous copy) and epoch_1.partial; the next save
    # removed both before writing, and a full disk then left no epoch_1 at all
    import dualkv_compile.models.checkpointer as checkpointer

    source = _saved_source(tmp_path)
    ck = Qwen3HFCheckpointer(str(source), str(tmp_path / "out"))
    state = {"model": qwen3_from_hf_config(source).state_dict()}
    ck.save_checkpoint(state, epoch=1)
    out = tmp_path / "out"
    before = (out / "epoch_1" / "model.safetensors").read_bytes()
    (out / "epoch_1").rename(out / "epoch_1.replaced")  # as the crash left them
    (out / "epoch_1.partial").mkdir()

    def full_disk(state, directory, rename):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpointer, "write_hf_state", full_disk)
    with pytest.raises(OSError, match="epoch_1 could not be written"):
        ck.save_checkpoint(state, epoch=1)
    assert sorted(p.name for p in out.iterdir()) == ["epoch_1"]
    assert (out / "epoch_1" / "model.safetensors").read_bytes() == before


def _moe_checkpoint(tmp_path, tied):
    cfg = tf.Qwen3MoeConfig(vocab_size=12, hidden_size=16, moe_intermediate_size=8,
                            num_experts=3, num_experts_per_tok=2, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                            tie_word_embeddings=tied)
    torch.manual_seed(0)
    tf.Qwen3MoeForCausalLM._from_config(cfg).save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path


def test_a_tied_moe_checkpoint_whose_head_differs_is_refused(tmp_path):
    folder = _moe_checkpoint(tmp_path, tied=True)
    state = read_hf_state(folder)
    state["lm_head.weight"] = state["model.embed_tokens.weight"] + 1
    (folder / "model.safetensors").unlink()
    write_hf_state(state, folder, rename=False)
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        Qwen3HFCheckpointer(str(folder), str(tmp_path / "out")).load_checkpoint()


def test_a_missing_expert_weight_is_named(tmp_path):
    folder = _moe_checkpoint(tmp_path, tied=False)
    state = read_hf_state(folder)
    del state["model.layers.0.mlp.experts.1.up_proj.weight"]
    (folder / "model.safetensors").unlink()
    write_hf_state(state, folder, rename=False)
    with pytest.raises(KeyError, match=r"model.layers.0.mlp.experts.1.\{up_proj\}.weight"):
        Qwen3HFCheckpointer(str(folder), str(tmp_path / "out")).load_checkpoint()


def test_the_grouped_expert_op_takes_no_tokens():
    from dualkv_compile.models.moe_experts import moe_experts

    hidden = torch.zeros(0, 16, dtype=torch.float64, requires_grad=True)
    gate_up = torch.randn(3, 2 * 8, 16, dtype=torch.float64, requires_grad=True)
    down = torch.randn(3, 16, 8, dtype=torch.float64, requires_grad=True)
    out = moe_experts(hidden, torch.zeros(0, 2, dtype=torch.long),
                      torch.zeros(0, 2, dtype=torch.float64), gate_up, down)
    assert out.shape == (0, 16)
    out.sum().backward()
    assert hidden.grad.shape == (0, 16) and (gate_up.grad == 0).all()


def test_non_default_rope_theta_eps_and_context_are_read(tmp_path):
    torch.manual_seed(0)
    cfg = tf.Qwen3Config(vocab_size=97, hidden_size=48, intermediate_size=96,
                         num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=300, rope_theta=1_000_000.0,
                         rms_norm_eps=1e-2, tie_word_embeddings=False)
    hf = tf.Qwen3ForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "rope_theta" not in saved or saved["rope_theta"] == 1_000_000.0
    ours = qwen3_from_hf_config(tmp_path)
    attn = ours.layers[0].attn
    assert attn.pos_embeddings.base == 1_000_000.0
    assert ours.norm.eps == 1e-2 and ours.layers[0].sa_norm.eps == 1e-2
    assert ours.max_seq_len == 300
    load_hf_checkpoint(ours, tmp_path)
    ours.eval()
    tokens = torch.randint(0, 97, (2, 40))
    pos = torch.arange(200, 240)[None].expand(2, -1)  # far positions: theta matters
    with torch.no_grad():
        ref = hf(input_ids=tokens, position_ids=pos, use_cache=False).logits
        got = ours(tokens, input_pos=pos)
    assert rel_err(got, ref) < 1e-5


def test_a_moe_model_untied_from_a_tied_checkpoint_saves_its_trained_head(tmp_path):
    # the export once dropped lm_head.weight because the source config.json ties them, and
    # copied that config: transformers then tied the trained head back to the embedding
    from dualkv_compile.models import qwen3_moe_from_hf_config

    source = _moe_checkpoint(tmp_path / "src", tied=True)
    ck = Qwen3HFCheckpointer(str(source), str(tmp_path / "out"))
    model = qwen3_moe_from_hf_config(source, tie_word_embeddings=False)
    model.load_state_dict(ck.load_checkpoint()["model"], strict=True)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)  # trained apart from the embedding
    folder = ck.save_checkpoint({"model": model.state_dict()}, epoch=1)
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is False
    back = tf.Qwen3MoeForCausalLM.from_pretrained(folder)
    assert torch.equal(back.lm_head.weight, model.lm_head.weight)
    assert torch.equal(back.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_a_tied_moe_model_saves_its_embedding_once_and_stays_tied(tmp_path):
    from dualkv_compile.models import qwen3_moe_from_hf_config

    source = _moe_checkpoint(tmp_path / "src", tied=True)
    ck = Qwen3HFCheckpointer(str(source), str(tmp_path / "out"))
    model = qwen3_moe_from_hf_config(source)
    model.load_state_dict(ck.load_checkpoint()["model"], strict=True)
    folder = ck.save_checkpoint({"model": model.state_dict()}, epoch=1)
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in read_hf_state(folder)


def test_a_null_kv_head_count_means_one_per_query_head(tmp_path):
    _dense_config(tmp_path)
    model = qwen3_from_hf_config(_null_field(tmp_path, "num_key_value_heads"))
    assert model.layers[0].attn.num_kv_heads == tf.Qwen3Config.from_pretrained(
        tmp_path).num_key_value_heads == 6


def _null_field(tmp_path, key):
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[key] = None
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("max_window_layers,refused", [(1, True), (2, False), (28, False)])
def test_sliding_layers_are_those_transformers_makes(tmp_path, max_window_layers, refused):
    # without layer_types, transformers slides only from layer max_window_layers on
    path = _dense_config(tmp_path, num_hidden_layers=2, layer_types=None,
                         use_sliding_window=True, sliding_window=8,
                         max_window_layers=max_window_layers)
    kinds = tf.Qwen3Config.from_pretrained(path).layer_types
    assert ("sliding_attention" in kinds) == refused
    if refused:
        with pytest.raises(ValueError, match="max_window_layers=1"):
            qwen3_from_hf_config(path)
    else:
        assert len(qwen3_from_hf_config(path).layers) == 2


def test_rope_parameters_per_layer_type_are_refused(tmp_path):
    # read as a flat dict they fell back to theta 10,000 without a word
    path = _dense_config(tmp_path, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    with pytest.raises(ValueError, match=r"rope parameters per layer type \(\['full_attention'\]\)"):
        qwen3_from_hf_config(path)


def test_a_tied_model_from_an_untied_checkpoint_saves_as_tied(tmp_path):
    # the reverse of the case above: no lm_head.weight was written and the copied config said
    # untied, so transformers initialised a random head
    source = _saved_source(tmp_path)  # untied
    assert json.loads((source / "config.json").read_text())["tie_word_embeddings"] is False
    model = qwen3_from_hf_config(source, tie_word_embeddings=True)
    folder = Qwen3HFCheckpointer(str(source), str(tmp_path / "out")).save_checkpoint(
        {"model": model.state_dict()}, epoch=1)
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is True
    back = tf.Qwen3ForCausalLM.from_pretrained(folder)
    assert torch.equal(back.lm_head.weight, model.tok_embeddings.weight)

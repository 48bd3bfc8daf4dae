"""The dualkv CLI on CPU: inspect, mask and plan on tiny models, errors, help and the flag set."""

import json
import re
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch

from dualkv_compile import pack
from dualkv_compile.attention.block_mask import BLOCK_SIZE, dense_mask
from dualkv_compile.testing import make_batch
from dualkv_compile.tools.cli import build_parser, main
from dualkv_compile.tools.models import PRESETS
from dualkv_compile.tools.plan_cmd import estimate
from recipe_helpers import ROOT

import transformers  # noqa: E402,F401  (a test dependency: fail loudly if it is missing)


def test_inspect_shows_each_pass_and_writes_graphs_and_svg(tmp_path, capsys):
    assert main(["inspect", "--model", "qwen2_5", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    sections = {part.split(" (")[0]: part for part in out.split("\n== ")}
    before = sections["graph traced by Dynamo"]
    after = sections["after the attention rewrite"]
    assert before.count("= scaled_dot_product_attention(") == 2
    assert "= scaled_dot_product_attention(" not in after  # as an op; source comments keep the line
    assert after.count("higher_order.flex_attention(") == 2
    assert "== after the LM-head cut" in out
    assert "attention kernel: CPU reference" in out
    assert "attention_rewritten: 2" in out and "lm_head_pruned: 1" in out
    assert "torchtune/modules/attention.py" in before  # source lines name the model's code
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["0_traced.txt", "1_attention_rewrite.txt", "2_token_locality.txt",
                     "3_lm_head.txt", "4_position_tables.txt", "attention_region.svg"]
    stored = sections["after storing the position tables"]
    assert stored.count("= materialize.default(") == 8  # cos, sin for q, k of 2 layers
    svg = ET.parse(tmp_path / "attention_region.svg").getroot()
    ns = "{http://www.w3.org/2000/svg}"
    labels = " ".join(t.text or "" for t in svg.iter(f"{ns}text"))
    assert "flex_attention" in labels
    # a label too long for its box is cut with an ellipsis; its tooltip holds all of it
    for box in svg.iter(f"{ns}g"):
        title = box.find(f"{ns}title").text.split("\n")
        for shown, whole in zip((t.text or "" for t in box.iter(f"{ns}text")), title):
            assert len(shown) <= 28
            assert shown == whole or (shown.endswith("\u2026") and whole.startswith(shown[:-1])
                                      and len(whole) > 28)
    assert any(t.text.endswith("\u2026") for t in svg.iter(f"{ns}text") if t.text)


def test_inspect_shows_the_regions_rewrite(tmp_path, capsys):
    assert main(["inspect", "--model", "hf_qwen3", "--attention-backend", "regions",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    after = {part.split(" (")[0]: part for part in out.split("\n== ")}["after the attention rewrite"]
    assert after.count("= regions_attention.default(") == 2
    assert "flex_attention" not in after
    assert "attention kernel: REGIONS on cpu" in out
    assert "regions_attention" in (tmp_path / "attention_region.svg").read_text()


def test_inspect_reports_a_refusal(monkeypatch, capsys):
    from dualkv_compile.passes import token_locality
    from dualkv_compile.passes._common import Refusal

    def refuse(*args, **kwargs):
        raise Refusal("cannot prove `cumsum` at model.py:3 token-local")

    monkeypatch.setattr(token_locality, "prove_token_locality", refuse)
    assert main(["inspect", "--model", "llama3_2"]) == 1
    out = capsys.readouterr().out
    assert "refused: cannot prove `cumsum` at model.py:3 token-local" in out
    assert "== after the attention rewrite" in out  # what ran before the refusal is shown


def test_inspect_a_config_json(tmp_path, capsys):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
           "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 3,
           "num_attention_heads": 2, "num_key_value_heads": 1}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["inspect", "--model", str(tmp_path), "--layers", "1"]) == 0
    assert "attention_rewritten: 1" in capsys.readouterr().out


def test_inspect_a_mixture_of_experts_config_json(tmp_path, capsys):
    # optimize() refused transformers' default expert implementation, with a fix the CLI user
    # could not apply; inspect now runs the experts as the grouped op
    cfg = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 4,
           "num_experts_per_tok": 2, "vocab_size": 200, "max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["inspect", "--model", str(tmp_path), "--layers", "1"]) == 0
    captured = capsys.readouterr()
    assert "Qwen3MoeForCausalLM" in captured.out and "attention_rewritten: 1" in captured.out
    # said before the build (a preset's random weights take up to a minute, silently)
    assert f"building {tmp_path} with random weights (1 layer)..." in captured.err


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_mask_counts_match_the_dense_mask(tmp_path, capsys):
    png = tmp_path / "m.png"
    args = ["--groups", "2", "--group-size", "3", "--prompt-len", "300", "--response-len", "200"]
    assert main(["mask", *args, "--scale", "4", "--out", str(png)]) == 0
    out = capsys.readouterr().out
    tokens, mask, p = make_batch([300, 300], [[200] * 3] * 2, generator=torch.Generator().manual_seed(0))
    pb = pack(tokens, prompt_len=p, padding_mask=mask)
    nb = pb.seq_len // BLOCK_SIZE
    tiles = dense_mask(pb).view(nb, BLOCK_SIZE, nb, BLOCK_SIZE).transpose(1, 2)
    full = int(tiles.all(-1).all(-1).sum())
    partial = int((tiles.any(-1).any(-1) & ~tiles.all(-1).all(-1)).sum())
    assert f"full blocks: {full}, partial blocks: {partial}, empty blocks: {nb * nb - full - partial}" in out
    assert _png_size(png) == (nb * 4, nb * 4)
    assert "some blocks hold two segments: FLASH runs flex's mask_mod form" in out


def test_mask_names_flash_causal_form_on_block_aligned_layouts(tmp_path, capsys):
    args = ["--groups", "1", "--group-size", "4", "--prompt-len", "256", "--response-len", "128"]
    assert main(["mask", *args, "--out", str(tmp_path / "m.png")]) == 0
    assert "every block lies in one segment: eager FLASH calls of the op run FA4's causal" in capsys.readouterr().out


def test_mask_ragged_prints_the_lengths_it_drew_with_its_seed(tmp_path, capsys):
    args = ["--groups", "2", "-N", "3", "-P", "100", "-R", "90", "--ragged",
            "--out", str(tmp_path / "m.png")]
    drawn = {}
    for seed in (0, 1):
        assert main(["mask", *args, "--seed", str(seed)]) == 0
        out = capsys.readouterr().out
        assert f"response lengths drawn (seed {seed}):" in out
        lengths = [[int(x) for x in line.split(":")[1].split()]
                   for line in out.splitlines() if line.startswith("  group ")]
        assert len(lengths) == 2 and all(len(g) == 3 and all(0 <= x <= 90 for x in g)
                                         for g in lengths)
        # the layout drawn is the one printed: its token reduction
        tokens, mask, p = make_batch([100, 100], lengths, generator=torch.Generator())
        packed = pack(tokens, prompt_len=p, padding_mask=mask)
        assert f"T={packed.seq_len} tokens" in out and f"rho={packed.rho:.2f}," in out
        drawn[seed] = lengths
    assert drawn[0] != drawn[1]


def test_mask_draws_more_groups_than_its_default_vocabulary(tmp_path, capsys):
    assert main(["mask", "--groups", "1200", "-N", "1", "-P", "1", "-R", "1",
                 "--out", str(tmp_path / "m.png")]) == 0
    assert "T=2432 tokens" in capsys.readouterr().out  # 1,200 groups of 2 tokens, padded to 128


def test_plan_prints_the_estimate(capsys):
    assert main(["plan", "--model", "qwen3-1.7b", "-N", "16", "-P", "4096", "-R", "1024",
                 "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "token reduction rho:          4.00x  (81920 -> 20480 tokens)" in out
    assert main(["plan", "--model", "llama3_2", "-N", "4", "-P", "10", "-R", "5"]) == 0
    tiny = capsys.readouterr().out
    assert "2 layers, d=32" in tiny and "token reduction rho:          2.00x  (60 -> 30 tokens)" in tiny
    assert "K parameters" in tiny and not re.search(r"(?<![\d.])0\.00", tiny)  # no 0.00 GiB
    assert "attention FLOP reduction:     2.50x (causal pairs)" in out
    assert "groups per micro-batch in 80 GiB, layer checkpointing:" in out
    e = estimate({"hidden": 8, "layers": 1, "heads": 2, "kv_heads": 1, "head_dim": 4, "ff": 16,
                  "vocab": 10, "tied": True}, 2, 3, 1, chunk=1)
    # by hand: q 8x8 + k,v 2x8x4 + o 8x8 + mlp 3x8x16 + norms 16 = 592; + embeddings 80 + 8
    assert e["params"] == 592 + 80 + 8
    assert e["rho"] == pytest.approx(8 / 5)


@pytest.mark.parametrize("name", ["qwen2_5", "llama3_2", "hf_qwen3", "hf_llama", "qwen3-0.6b"])
def test_plan_counts_the_parameters_the_model_has(name):
    # the transformers tiny models were counted as tied (13% low), Qwen2's q/k/v biases and
    # Qwen3's q/k norms were left out
    from dualkv_compile.models import qwen3_0_6b
    from dualkv_compile.testing import tiny_model
    from dualkv_compile.tools.models import model_dims

    with torch.device("meta"):
        model = qwen3_0_6b() if name == "qwen3-0.6b" else tiny_model(name)
    assert estimate(model_dims(name), 1, 1, 1)["params"] == sum(
        p.numel() for p in model.parameters())


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2"])
def test_plan_counts_attention_biases_as_transformers_builds_them(kind, tmp_path):
    # attention_bias=True puts a bias on o_proj too (Llama, Qwen3); Qwen2's q/k/v always
    from dualkv_compile.tools.models import model_dims

    fields = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, vocab_size=101,
                  tie_word_embeddings=False, **({} if kind == "qwen2" else
                                                dict(attention_bias=True)))
    if kind == "qwen3":
        fields["head_dim"] = 8
    cfg = transformers.AutoConfig.for_model(kind, **fields)
    (tmp_path / "config.json").write_text(cfg.to_json_string())
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert estimate(model_dims(str(tmp_path / "config.json")), 1, 1, 1)["params"] == sum(
        p.numel() for p in model.parameters())


def test_plan_notes_a_model_type_optimize_refuses(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}))
    assert main(["plan", "--model", str(tmp_path), "--group-size", "4", "--prompt-len", "16",
                 "--response-len", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("note: optimize() refuses model_type 'bert'")


def test_plan_refuses_shared_experts_it_would_leave_out(tmp_path, capsys):
    # a Qwen2-MoE config planned as 13.49B parameters with or without its shared expert
    # (transformers counts 14.32B)
    cfg = {"model_type": "qwen2_moe", "hidden_size": 2048, "num_hidden_layers": 24,
           "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 5632,
           "moe_intermediate_size": 1408, "num_experts": 60, "num_experts_per_tok": 4,
           "shared_expert_intermediate_size": 5632, "vocab_size": 151936}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", "--model", str(tmp_path), "-N", "8", "-P", "512", "-R", "128"]) == 2
    assert ('{"shared_expert_intermediate_size": 5632} describe a structure plan does not '
            "model") in capsys.readouterr().err


def test_plan_counts_every_expert_and_the_logits_once_per_micro_batch(tmp_path, capsys):
    # a Qwen3-30B-A3B config was planned as a 3.3B dense model, and the LM head's chunk of
    # logits (one per micro-batch) was counted once per group
    cfg = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
           "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
           "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
           "num_experts_per_tok": 8, "vocab_size": 151936}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", "--model", str(tmp_path), "-N", "32", "-P", "8192", "-R", "1024",
                 "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "30.53B parameters" in out and "128 experts of ff=768, 8 a token" in out
    assert "in 80 GiB: none; the training state and one chunk of logits alone need 348.2 GiB" in out
    dims = dict(hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, ff=768,
                vocab=151936, tied=False)
    dense, moe = estimate(dims, 32, 8192, 1024), estimate(dims | dict(experts=128, active=8),
                                                           32, 8192, 1024)
    attn_flops = 12 * 128 * 32 * 48 * (8192 * 8193 // 2 + 32 * (8192 * 1024 + 1024 * 1025 // 2))
    head_flops = 6 * 151936 * 2048 * 32 * 1024
    per_token_mlp = 6 * 48 * (8 - 1) * 3 * 2048 * 768 + 6 * 48 * 2048 * 128  # 7 more experts
    assert moe["flops_dualkv"] - dense["flops_dualkv"] == per_token_mlp * (8192 + 32 * 1024)
    assert dense["flops_dualkv"] > attn_flops + head_flops
    e = estimate(PRESETS["qwen3-0.6b"], 16, 2048, 512)
    assert main(["plan", "--model", "qwen3-0.6b", "-N", "16", "-P", "2048", "-R", "512",
                 "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    free = 80 * 2**30 - e["static_bytes"] - e["logits_bytes"]
    fit = [int(free // e[f"checkpointed_bytes_{k}"]) for k in ("plain", "dualkv")]
    assert f"layer checkpointing: plain {fit[0]}, dualkv {fit[1]}" in out and fit[1] > 60


FLAGS = {  # -N / --group-size, -P / --prompt-len, -R / --response-len: one spelling everywhere
    "inspect": ["--attention-backend", "--group-size", "--groups", "--help", "--layers", "--model", "--out",
                "--prompt-len", "--response-len", "-N", "-P", "-R", "-h"],
    "mask": ["--group-size", "--groups", "--help", "--out", "--pad-to", "--prompt-len",
             "--ragged", "--response-len", "--scale", "--seed", "-N", "-P", "-R", "-h"],
    "plan": ["--gpu-memory", "--group-size", "--help", "--model", "--prompt-len",
             "--response-len", "--state-bytes", "-N", "-P", "-R", "-h"],
    "bench": ["--help", "-h"],
}


def test_the_flag_set_is_frozen():
    parser = build_parser()
    subs = next(a for a in parser._actions if a.dest == "command").choices
    found = {name: sorted(s for a in sub._actions for s in a.option_strings)
             for name, sub in subs.items()}
    assert found == FLAGS


def test_docs_name_every_flag():
    text = (ROOT / "docs" / "cli.md").read_text()
    missing = [flag for flags in FLAGS.values() for flag in flags
               if flag.startswith("--") and flag != "--help" and flag not in text]
    assert not missing, f"docs/cli.md does not document {missing}"


@pytest.mark.parametrize("command", sorted(FLAGS))
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    assert f"usage: dualkv {command}" in capsys.readouterr().out


def test_module_entry_point():
    done = subprocess.run([sys.executable, "-m", "dualkv_compile.tools", "plan", "--model",
                           "qwen3-0.6b", "-N", "4", "-P", "128", "-R", "64"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "token reduction rho" in done.stdout


def test_inspect_traces_the_flex_graph_for_a_gpu_kernel_and_refuses_merged_groups(capsys):
    # --attention-backend flash/triton was offered but always refused (the CPU model); and
    # more groups than the tiny vocabulary holds distinct prompts for were merged silently
    assert main(["inspect", "--model", "hf_llama", "--attention-backend", "triton"]) == 0
    assert "flex_attention" in capsys.readouterr().out
    assert main(["inspect", "--model", "qwen2_5", "--groups", "200", "--group-size", "2",
                 "-P", "1", "-R", "1"]) == 2
    assert "--groups 200: qwen2_5's vocabulary of 101 tokens holds distinct prompts for at " \
           "most 99 groups" in capsys.readouterr().err

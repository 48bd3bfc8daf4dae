"""The benchmark suite's CPU-side pieces: dispatch, the ragged cases and tile counts, the step
benchmark's layouts, profile gaps and AdamW variants, and `ab --prepare` (timings need a GPU)."""

import subprocess
import sys

import pytest
import torch

from dualkv_compile import pack
from dualkv_compile.testing import make_batch
from dualkv_compile.tools.cli import main
from recipe_helpers import ROOT


def test_bench_suite_dispatches_each_benchmark(monkeypatch, capsys):
    """`dualkv bench NAME ARGS` and `python -m dualkv_compile.tools.bench NAME ARGS` hand the
    arguments to the benchmark's main; `model` is the step benchmark without the optimizer."""
    import importlib

    from dualkv_compile.tools import bench

    calls = []
    for name, (module, _) in bench.SUITE.items():
        monkeypatch.setattr(importlib.import_module(module), "main",
                            lambda argv, prog, module=module: calls.append((module, argv, prog)))
    assert main(["bench", "attention", "--shapes", "1,128,128"]) == 0
    bench.main(["model", "--layers", "2"])
    bench.main(["step"])
    module_prog = "python -m dualkv_compile.tools.bench"
    assert calls == [("dualkv_compile.tools.bench_attention", ["--shapes", "1,128,128"],
                      "dualkv bench attention"),
                     ("dualkv_compile.tools.bench_policy_update", ["--no-optimizer", "--layers", "2"],
                      f"{module_prog} model"),
                     ("dualkv_compile.tools.bench_policy_update", [], f"{module_prog} step")]
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["speed"])
    assert exit_info.value.code == 2
    assert "unknown benchmark 'speed'" in capsys.readouterr().err


def test_ragged_benchmark_cases_are_seeded_and_within_the_issue_ranges():
    # the layouts of `dualkv bench ragged` (GPU-only timing): 2-8 groups of N in {8, 16, 32},
    # prompts in [0.1, 1] x the P cap, responses in [1, R cap], replicated tokens within the
    # budget (groups dropped from the end), the same batch for the same seed
    from dualkv_compile.tools.bench_ragged import CAPS, ragged_case

    sizes = set()
    for p_cap, r_cap in CAPS:
        for seed in range(6):
            tokens, mask, p, n, prompts, responses = ragged_case(seed, p_cap, r_cap, 262144)
            assert n in (8, 16, 32) and 1 <= len(prompts) <= 8 and p == max(prompts)
            assert all(p_cap // 10 <= x <= p_cap for x in prompts)
            assert all(1 <= r <= r_cap for rs in responses for r in rs)
            assert int(mask.sum()) == sum(x * n + sum(rs) for x, rs in zip(prompts, responses))
            assert int(mask.sum()) <= 262144 or len(prompts) == 1
            sizes.add((len(prompts), n))
            again = ragged_case(seed, p_cap, r_cap, 262144)
            assert torch.equal(tokens, again[0]) and torch.equal(mask, again[1])
    assert len(sizes) > 3  # the seeds give different group counts and sizes


def test_step_profile_idle_gaps_count_overlaps_once_and_sort_longest_first():
    from dualkv_compile.tools.step_profile import idle_gaps

    kernels = [(10.0, 50.0, "a"), (40.0, 60.0, "b"), (100.0, 130.0, "c"), (135.0, 140.0, "d"),
               (0.0, 5.0, "before the window")]
    busy, gaps = idle_gaps(kernels, start=2.0, end=200.0, min_us=10.0)
    assert busy == 3.0 + 50.0 + 30.0 + 5.0  # the clipped first kernel, a..b merged, c, d
    # 5 -> 10 (5 us) and 130 -> 135 are below min_us; 60 -> 100 and 140 -> 200 are not
    assert gaps == [(140.0, 60.0, "d", None), (60.0, 40.0, "b", "c")]
    # a kernel after the window counts for nothing
    busy, gaps = idle_gaps([(10.0, 20.0, "a"), (250.0, 260.0, "z")], start=0.0, end=200.0,
                           min_us=5.0)
    assert busy == 10.0 and gaps == [(20.0, 180.0, "a", None), (0.0, 10.0, None, "a")]


def test_step_benchmark_compiled_adamw_steps_like_eager_adamw():
    from dualkv_compile.tools.bench_policy_update import make_adamw

    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3, dtype=torch.float64)) for _ in range(2)]
    b = [torch.nn.Parameter(x.detach().clone()) for x in a]
    start = [x.detach().clone() for x in a]
    from torch._dynamo.utils import counters

    eager, compiled = torch.optim.AdamW(a, lr=1e-6), make_adamw(b, "compiled")
    graphs = counters["stats"]["unique_graphs"]
    for step in range(3):
        for x, y in zip(a, b):
            x.grad = torch.randn_like(x)
            y.grad = x.grad.clone()
        eager.step()
        compiled.step()
    for x, y, x0 in zip(a, b, start):
        moved = x.detach() - x0
        assert moved.abs().max() > 1e-6  # three steps of about lr each
        # the compiled step keeps Adam's step counts as float32 tensors (bias corrections
        # rounded there); eager AdamW uses Python floats: the updates agree to ~1e-5
        torch.testing.assert_close(y.detach() - x0, moved, rtol=1e-4, atol=0)
    assert counters["stats"]["unique_graphs"] > graphs  # the step did run under Dynamo


def test_bench_ab_prepares_another_commit_that_imports_beside_this_one(tmp_path):
    # `dualkv bench ab --prepare` renames the package and its ops so both load in one process;
    # the other copy (here HEAD) must compute what this tree computes (CPU fp64, both the
    # reference and the regions kernel). A subprocess keeps the second op namespace out of ours.
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                      capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: --prepare reads the commit from git")
    from dualkv_compile.tools.bench_ab import main

    main(["--prepare", "HEAD", "--other-dir", str(tmp_path)])
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()  # recorded in the results' meta
    assert (tmp_path / "dualkv_other" / "PREPARED_FROM_COMMIT").read_text() == head + "\n"
    script = f"""
import sys, torch
sys.path.insert(0, {str(tmp_path)!r})
import dualkv_compile as this, dualkv_other as other
from dualkv_compile.testing import make_batch
assert other.__file__.startswith({str(tmp_path)!r})
tokens, mask, p = make_batch([37, 20], [[5, 9], [3, 4]], vocab=100)
for kernel in ("auto", "regions"):
    outs = []
    for lib in (this, other):
        pb = lib.pack(tokens, prompt_len=p, padding_mask=mask)
        torch.manual_seed(0)
        x = [torch.randn(1, h, pb.seq_len, 16, dtype=torch.float64) for h in (4, 2, 2)]
        outs.append(lib.shared_prefix_attention(*x, pb, attention_backend=kernel))
    assert torch.equal(outs[0], outs[1]), kernel
print("same")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "same", proc.stderr[-2000:]


def test_step_benchmark_ragged_layouts_and_their_aligned_twins():
    # `bench step --ragged P,R,SEED`: bench_ragged's layout, then an aligned batch of as many
    # groups and rows at the mean lengths; useful FLOPs count the packed computation exactly
    import argparse

    import transformers as tf

    from dualkv_compile.tools.step_inputs import layouts, useful_flops

    args = argparse.Namespace(shapes=[(4, 64, 16)], ragged=[(2048, 512, 0)], vocab=151936,
                              max_tokens=262144)
    (aligned, ragged, twin, block_twin) = list(layouts(args))
    assert block_twin[3] % 128 == 0 and (block_twin[2].sum(1) % 128 == 0).all()
    assert aligned[0] == (4, 64, 16) and aligned[1].shape == (4, 80) and aligned[2].all()
    (n, _, _), tokens, mask, p = ragged
    _, tokens2, mask2, p2 = twin
    assert tokens.shape[0] == tokens2.shape[0] and int(tokens.max()) < 151936
    a, b = pack(tokens, prompt_len=p, padding_mask=mask), pack(tokens2, prompt_len=p2,
                                                               padding_mask=mask2)
    assert a.num_groups == b.num_groups > 1
    assert abs(a.num_tokens - b.num_tokens) <= a.num_groups * (n + 1)  # rounding of the means
    cfg = tf.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = tf.Qwen3ForCausalLM(cfg)
    n, p, r = 4, 64, 16
    packed = pack(aligned[1] % 64, prompt_len=p, padding_mask=aligned[2])
    layer_params = sum(q.numel() for q in model.model.layers.parameters() if q.dim() == 2)
    pairs = p * (p + 1) // 2 + n * (p * r + r * (r + 1) // 2)
    assert useful_flops(model, packed) == (6 * layer_params * (p + n * r)
                                           + 12 * 8 * 4 * pairs * 2 + 6 * 64 * 32 * n * r)

def test_ragged_benchmark_counts_tiles_by_hand(capsys):
    # one prompt of 2 blocks, two responses of 1 block: the BlockMask visits the prompt's 3
    # causal tiles and, per response, 2 prompt tiles and its own diagonal (4 diagonals are
    # partial); a causal varlen kernel visits 3 * 4 / 2 = 6 tiles in each 3-block row
    from dualkv_compile.tools.bench_ragged import main as ragged_main, tile_counts

    tokens, mask, p = make_batch([256], [[128, 128]], vocab=100)
    assert tile_counts(pack(tokens, prompt_len=p, padding_mask=mask), mask) == {
        "ours": 9, "partial": 4, "varlen": 12}
    ragged_main(["--tiles-only", "--caps", "2048,512", "--seeds", "0", "--aligned-twins"])
    table = capsys.readouterr().out  # runs without a GPU
    assert "| 2048 | 512 | 0 | ragged | 6 x 8 | 2.28 | 1298 (40%) | 2753 | 0.93 |" in table
    # the twin: the same draws rounded up to whole blocks (only diagonal tiles are partial)
    assert "| 2048 | 512 | 0 | block-aligned twin | 6 x 8 | 2.13 | 1427 (11%) | 3107 | 1.02 |" in table


def test_a_block_aligned_twin_rounds_each_length_up_to_a_whole_block():
    from dualkv_compile.tools.bench_ragged import ragged_case

    *_, n, prompts, responses = ragged_case(3, 2048, 512, 262144)
    *_, n2, prompts2, responses2 = ragged_case(3, 2048, 512, 262144, aligned=True)
    up = lambda x: -(-x // 128) * 128  # noqa: E731
    assert n2 == n and prompts2 == [up(x) for x in prompts] and any(x % 128 for x in prompts)
    assert responses2 == [[up(x) for x in rs] for rs in responses]


def test_an_aligned_twin_over_the_token_budget_is_noted(capsys):
    # seed 0 at (2048, 512) under 20000 tokens: the ragged case fits (15781), its twin (17792)
    # did not, without a note
    from dualkv_compile.tools.bench_ragged import ragged_case

    ragged_case(0, 2048, 512, 20000)
    assert capsys.readouterr().err == ""
    ragged_case(0, 2048, 512, 17000, aligned=True)
    assert ("note: seed 0, caps 2048,512: its aligned twin replicates to 17792 tokens, over "
            "--max-tokens 17000") in capsys.readouterr().err


def test_attention_table_takes_a_first_row_whose_packed_tensors_ran_out_of_memory():
    # the columns came from the first row: its "ours_error" string was read as a variant
    # (AttributeError, nothing written), and its dense columns read "OOM/err", never timed
    from dualkv_compile.tools.bench_attention import NOT_TIMED, markdown

    meta = {"dtype": "bfloat16", "hq": 32, "hkv": 8, "d": 128, "gpu": "H100", "torch": "2.11",
            "triton": "3.6", "cuda": "13.0", "rounds": 5, "warmup_ms": 25, "rep_ms": 100}
    base = {"N": 8, "P": 4096, "R": 512, "tokens": 8192, "pair_reduction": 3.0,
            "block_mask_ms": 1.0}
    oom = base | {"ours_error": "OOM allocating the packed tensors next to the dense ones",
                  "dense_flash": {"ms": None, "error": NOT_TIMED},
                  "dense_cudnn": {"ms": None, "error": NOT_TIMED}}
    ran = base | {"dense_flash": {"ms": 9.0}, "dense_cudnn": {"ms": 6.0},
                  "ours_auto": {"ms": 2.0, "speedup_vs_best_dense": 3.0,
                                "speedup_over_ideal": 1.0, "first_call_s": 4.0}}
    lines = markdown(meta, [oom, ran]).splitlines()
    assert "ours_auto ms" in lines[2] and "ours_error" not in lines[2], lines[2]
    assert lines[4].startswith("| 8 | 4096 | 512 | 8192 | not timed | not timed | OOM/err |")
    assert lines[5].startswith("| 8 | 4096 | 512 | 8192 | 9.00 | 6.00 | 2.00 | 3.00 | 1.00 |")

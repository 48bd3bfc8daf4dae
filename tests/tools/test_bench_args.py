"""The benchmarks' arguments: a bad value is the parser's one line naming it (exit 2) before
any model is built or anything timed, never a traceback from the middle of the work."""

import json
import os

import pytest
import torch

from dualkv_compile.tools.cli import main


def _refused(argv, capsys) -> str:
    """main(argv)'s one-line error (exit 2)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("argv, message", [
    # step took --ragged as strings and unpacked them after building the model
    (["step", "--ragged", "4096,1024", "--layers", "1"],
     "argument --ragged: ragged case '4096,1024' must be P_cap,R_cap,seed (three integers)"),
    (["model", "--ragged", "4096,0,1"], "ragged case '4096,0,1': P_cap and R_cap must be positive"),
    (["step", "--ragged", "4096,1024,-1"],
     "ragged case '4096,1024,-1': the seed must be in [0, 2**63)"),
    (["mask-forms", "--ragged", "2048,512,x"],
     "argument --ragged: ragged case '2048,512,x' must be P_cap,R_cap,seed"),
    (["ab", "--other-dir", "/tmp/x", "--shapes", "16,4096"],
     "argument --shapes: shape '16,4096' must be N,P,R (three integers)"),
    (["ragged", "--caps", "2048,512,0"],
     "argument --caps: caps '2048,512,0' must be P_cap,R_cap (two integers)"),
    (["ragged", "--caps", "0,512"], "caps '0,512': P_cap and R_cap must be positive"),
])
def test_layout_arguments_are_parsed_before_the_work(argv, message, monkeypatch, capsys):
    _assert_bench_refuses(argv, message, monkeypatch, capsys)


def _assert_bench_refuses(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # never past the arguments
    err = _refused(["bench", *argv], capsys)
    assert err.startswith(f"dualkv bench {argv[0]}: error: ") and message in err, err


@pytest.mark.parametrize("argv, message", [
    # --rounds 0 timed nothing and ended in StatisticsError (no median of no rounds)
    (["linears", "--tokens", "128", "--rounds", "0"], "argument --rounds: 0 must be at least 1"),
    (["linears", "--tokens", "0"], "argument --tokens: 0 must be at least 1"),
    (["lm-head", "--rows", "128", "--rounds", "0"], "argument --rounds: 0 must be at least 1"),
    (["lm-head", "--chunks", "0"], "argument --chunks: 0 must be at least 1"),
    (["lm-head", "--vocab", "-5"], "argument --vocab: -5 must be at least 1"),
    # --steps 0 reached median([]) after the compiles; the rest failed inside the model or loss
    (["step", "--steps", "0"], "argument --steps: 0 must be at least 1"),
    (["step", "--warmup", "0"], "argument --warmup: 0 must be at least 1"),
    (["model", "--layers", "0"], "argument --layers: 0 must be at least 1"),
    (["step", "--vocab", "5"], "argument --vocab: 5 must be at least 19"),
    (["step", "--plain-micro-batch", "0"], "argument --plain-micro-batch: 0 must be at least 1"),
    (["step", "--logprob-chunk-size", "4096", "0"],
     "argument --logprob-chunk-size: 0 must be at least 1"),
    (["step", "--max-tokens", "-1"], "argument --max-tokens: -1 must be at least 1"),
    (["step", "--memory-budget", "1.5"], "argument --memory-budget: 1.5 must be in (0, 1]"),
    (["step", "--peak-tflops", "0"], "argument --peak-tflops: 0.0 must be a finite number above 0"),
    (["step", "--peak-tflops", "nan"], "argument --peak-tflops: nan must be a finite number"),
    (["rollout", "--layers", "0"], "argument --layers: 0 must be at least 1"),
    (["rollout", "--groups", "1", "0"], "argument --groups: 0 must be at least 1"),
    (["rollout", "--baseline-steps", "0"], "argument --baseline-steps: 0 must be at least 1"),
    (["rollout", "--shapes", "16,16000,1024"],
     "--shapes 16,16000,1024: P + R = 17024 positions, more than the models' 16384"),
    (["rollout", "--profile", "/nonexistent/dir/prof"],
     "--profile /nonexistent/dir/prof: no such directory: /nonexistent/dir"),
    (["mask-forms", "--rounds", "0"], "argument --rounds: 0 must be at least 1"),
    (["mask-forms", "--rep-ms", "0"], "argument --rep-ms: 0 must be at least 1"),
    (["mask-forms", "--max-tokens", "0"], "argument --max-tokens: 0 must be at least 1"),
    (["ab", "--other-dir", "/tmp/x", "--ragged-seeds", "-1"],
     "argument --ragged-seeds: -1 must be in [0, 2**63)"),
])
def test_counts_are_checked_by_argparse(argv, message, monkeypatch, capsys):
    _assert_bench_refuses(argv, message, monkeypatch, capsys)


def test_ab_without_a_prepared_other_dir_is_one_line(tmp_path, monkeypatch, capsys):
    # the other package was imported from --other-dir unchecked: a ModuleNotFoundError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the check needs no GPU
    err = _refused(["bench", "ab", "--other-dir", str(tmp_path)], capsys)
    assert (f"--other-dir {tmp_path}: holds no dualkv_other package; write one with --prepare "
            f"COMMIT") in err, err


@pytest.mark.parametrize("argv, message", [
    (["--ragged", "2048,512,0"], "--backend flash needs flash-attn-4 on this GPU: flash-attn-4 is "
     "not installed (pip install 'dualkv-compile[flash]'); --backend triton runs without it"),
    (["--backend", "triton", "--ragged", "2048,512,0", "--varlen"],
     "--varlen needs flash-attn-4 on this GPU: flash-attn-4 is not installed"),
    (["--ragged", "2048,512,0", "--varlen"], "--backend flash and --varlen need flash-attn-4"),
])
def test_mask_forms_without_flash_attn_4_is_one_line(argv, message, monkeypatch, capsys):
    # the default --backend flash without flash-attn-4 was a ValueError traceback from
    # kernel_options_for (after the environment was recorded); --varlen an ImportError later
    from dualkv_compile.attention import selection

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # refused before any GPU call
    monkeypatch.setattr(selection, "flash_status", lambda *a, **k: (
        False, "flash-attn-4 is not installed (pip install 'dualkv-compile[flash]')"))
    err = _refused(["bench", "mask-forms", *argv], capsys)
    assert err.startswith("dualkv bench mask-forms: error: ") and message in err, err


def _ragged_tiles(out, *more) -> list[str]:
    # the benchmark that runs without a GPU, and writes --out
    return ["bench", "ragged", "--tiles-only", "--caps", "256,64", *more, "--seeds", "0",
            "--out", out, "--overwrite"]


def test_bench_out_refuses_an_earlier_runs_results(tmp_path, capsys):
    """OUT.json or OUT.md of an earlier run is not replaced without --overwrite: refused before
    any work (a Reproduce loop with one OUT kept only its last case, silently)."""
    out = tmp_path / "r"
    (tmp_path / "r.md").write_text("earlier")
    argv = _ragged_tiles(str(out))[:-1]  # without --overwrite
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert (f"--out {out}: {out}.md exists (an earlier run's results); pass --overwrite to "
            f"replace it, or name another OUT") in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.md"]
    assert (tmp_path / "r.md").read_text() == "earlier"
    assert main(argv + ["--overwrite"]) == 0
    assert (tmp_path / "r.md").read_text().startswith("128 x 128 tiles")


def test_results_record_the_command_and_the_commit(tmp_path, monkeypatch):
    # no result said which command and code produced it; outside a checkout, DUALKV_COMMIT
    from dualkv_compile.tools import _common

    out = str(tmp_path / "r")
    for checkout, expected in ((True, None), (False, "abc123")):
        if not checkout:
            monkeypatch.setattr(_common, "commit_of", lambda *a, **k: None)
            monkeypatch.setenv("DUALKV_COMMIT", "abc123")
        assert main(_ragged_tiles(out)) == 0
        meta = json.loads((tmp_path / "r.json").read_text())["meta"]
        assert meta["command"] == ("dualkv bench ragged --tiles-only --caps 256,64 --seeds 0 "
                                   f"--out {out} --overwrite")
        commit = _common.commit_of(os.path.dirname(_common.__file__), working_tree=True)
        assert meta["commit"] == (expected or commit or
                                  "unknown (not a git checkout and DUALKV_COMMIT unset)"), meta
        assert (tmp_path / "r.md").read_text().endswith(
            f"`{meta['command']}` at {meta['commit']}\n")


def test_an_interrupted_benchmark_keeps_the_rows_it_measured(tmp_path, monkeypatch, capsys):
    """OUT.json and OUT.md are written after every row, marked incomplete until the run ends:
    an interruption (Ctrl-C, a time limit, an out-of-memory error) in a later case keeps the
    earlier ones (they were written only at the end)."""
    from dualkv_compile.tools import bench_ragged

    real, calls = bench_ragged.run_case, []

    def run_case(*args, **kwargs):
        calls.append(args)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_ragged, "run_case", run_case)
    out = tmp_path / "r"
    assert main(_ragged_tiles(str(out), "512,128", "1024,256")) == 130
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [(x["P_cap"], x["R_cap"]) for x in lines] == [(256, 64), (512, 128)]  # as measured
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["meta"]["incomplete"] is True and saved["rows"] == lines
    assert "(incomplete: the first 2 rows" in (tmp_path / "r.md").read_text()
    monkeypatch.undo()
    assert main(_ragged_tiles(str(out))) == 0  # a finished run is not marked
    assert "incomplete" not in (tmp_path / "r.json").read_text() + (tmp_path / "r.md").read_text()


def test_bench_out_writes_json_and_markdown_together(tmp_path, monkeypatch, capsys):
    """A failed write leaves the earlier OUT.json and OUT.md as they were (the JSON was replaced
    before the markdown failed, and the error did not say so), and no temporary file; the error
    names the benchmark and the file, exit 1 (an output that cannot be written)."""
    import errno

    from dualkv_compile.tools import _common

    out = tmp_path / "r"
    for suffix in (".json", ".md"):
        (tmp_path / f"r{suffix}").write_text("earlier")

    def full_disk(path, *args, **kwargs):  # the markdown's write fails
        if ".md" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return open(path, *args, **kwargs)

    monkeypatch.setattr(_common, "open", full_disk, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(_ragged_tiles(str(out)))
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.strip() == (f"dualkv bench ragged: error: cannot write {out}.md (No space left on "
                           f"device); neither {out}.json nor {out}.md was replaced"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.md"]
    assert all((tmp_path / n).read_text() == "earlier" for n in ("r.json", "r.md"))

    monkeypatch.undo()
    real_replace = _common.os.replace

    def replace(src, dst):  # the markdown's rename fails after the JSON's
        if dst.endswith(".md"):
            raise OSError(errno.EACCES, "Permission denied")
        real_replace(src, dst)

    monkeypatch.setattr(_common.os, "replace", replace)
    with pytest.raises(SystemExit) as exit_info:
        main(_ragged_tiles(str(out)))
    assert exit_info.value.code == 1
    assert (f"cannot write {out}.md (Permission denied); {out}.json was replaced, {out}.md was "
            f"not") in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.md"]

    monkeypatch.undo()
    assert main(_ragged_tiles(str(out))) == 0
    table = (tmp_path / "r.md").read_text()
    printed = table[:table.rindex("\n`dualkv bench ragged")]  # the file adds run_record's line
    assert table.startswith("128 x 128 tiles") and printed in capsys.readouterr().out
    assert '"tiles_only": true' in (tmp_path / "r.json").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.md"]


@pytest.mark.parametrize("given", [["--shapes=2,64,32"], ["--shape", "2,64,32"],
                                   ["--shapes", "2,64,32"]])
def test_ragged_keeps_shapes_given_in_any_spelling(given):
    # step and mask-forms searched argv for the literal "--shapes": --shapes=... and the
    # abbreviation --shape were dropped for --ragged's layouts alone
    from dualkv_compile.tools._common import (OneLineParser, add_shapes_argument,
                                              parse_ragged_case, ragged_only)

    ap = OneLineParser(prog="t")
    add_shapes_argument(ap, ["16,4096,1024"])
    ap.add_argument("--ragged", type=parse_ragged_case, nargs="+", default=[])
    args = ap.parse_args([*given, "--ragged", "1024,256,0"])
    ragged_only(ap, args)
    assert args.shapes == [(2, 64, 32)]
    args = ap.parse_args(["--ragged", "1024,256,0"])
    ragged_only(ap, args)
    assert args.shapes == []
    args = ap.parse_args([])
    ragged_only(ap, args)
    assert args.shapes == [(16, 4096, 1024)]


@pytest.mark.parametrize("argv,message", [
    (["--min-gain", "0"], "tuning needs a CUDA GPU"),  # parsed: 0 keeps any faster candidate
    (["--min-gain", "-1"], "argument --min-gain: -1.0 must be a finite number >= 0"),
    (["--gqa", "3"], "--gqa 3 does not divide --heads 32"),
    (["--shape", "16,2048"], "shape '16,2048' must be N,P,R"),
])
def test_tune_kernel_options_arguments(argv, message, capsys, monkeypatch):
    from dualkv_compile.tools import tune_kernel_options

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # parsing only, never tuning
    with pytest.raises(SystemExit) as exit_info:
        tune_kernel_options.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_wheel_inside_another_projects_git_tree_records_no_commit_of_it(tmp_path):
    # commit_of took any enclosing checkout: a wheel in a project's .venv recorded that
    # project's commit (and ignored DUALKV_COMMIT)
    import subprocess

    from dualkv_compile.tools._common import own_checkout

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    installed = tmp_path / ".venv" / "lib" / "dualkv_compile" / "tools"
    installed.mkdir(parents=True)
    (tmp_path / "tools").mkdir()
    assert not own_checkout(str(installed)) and own_checkout(str(tmp_path / "tools"))
    assert not own_checkout(str(tmp_path.parent))  # outside any checkout

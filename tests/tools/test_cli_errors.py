"""The CLI's refusals: every user error exits 2 with one line naming the bad value, before any
work (positions past a model's maximum, malformed config.json, --out paths, image sizes, a
benchmark without a GPU, malformed --caps)."""

import importlib
import json
import os

import pytest
import torch

from dualkv_compile.tools.cli import main


@pytest.mark.parametrize("argv,message", [
    (["plan", "--model", "nope", "-N", "1", "-P", "1", "-R", "1"], "unknown model 'nope'"),
    (["inspect", "--model", "llama-9000"], "unknown model 'llama-9000'"),
    (["plan", "--model", "qwen3-8b", "-N", "0", "-P", "1", "-R", "1"], "-N 0: must be at least 1"),
    (["plan", "--model", "/nonexistent/config.json", "-N", "1", "-P", "1", "-R", "1"],
     "no such file: /nonexistent/config.json"),
    (["mask", "--out", "/nonexistent/dir/m.png"], "no such directory: /nonexistent/dir"),
    (["mask", "--pad-to", "100", "--out", "m.png"], "--pad-to 100: must be a multiple of 128"),
    (["mask", "--groups", "0", "--out", "m.png"], "0 must be at least 1"),
    (["bench", "nope"], "invalid choice: 'nope'"),
    # past the tiny models' positions (they are built with what the layout needs, up to 8192)
    (["inspect", "--model", "qwen2_5", "-P", "9000", "-R", "300"],
     "prompt + response = 9300 positions, more than qwen2_5's maximum of 8192"),
    (["inspect", "--model", "hf_llama", "--layers", "3"],
     "--layers 3: the tiny family hf_llama has 2 layers"),
    (["plan", "--model", "qwen3-8b", "-N", "2", "-P", "3", "-R", "4", "--gpu-memory", "nan"],
     "--gpu-memory nan: must be a number of GiB in (0, 1,000,000]"),
    (["plan", "--model", "qwen3-8b", "-N", "2", "-P", "3", "-R", "4", "--gpu-memory", "inf"],
     "--gpu-memory inf: must be a number of GiB in (0, 1,000,000]"),
    (["mask", "--scale", "100000", "--out", "m.png"],
     "--scale 100000: 1x1 blocks of 100000 px make 100,000 px a side, more than the limit of "
     "4096: use --scale 4096 or less"),
    (["mask", "--pad-to", "1280000000", "--out", "m.png"], "packs 1,280,000,000 tokens"),
    (["bench"], "the following arguments are required: name"),
    (["plan", "--model", "qwen3-8b", "-N", "2", "-P", "3", "-R", "4", "--gpu-memory", "1e300"],
     "--gpu-memory 1e+300: must be a number of GiB in (0, 1,000,000]"),  # inf once in bytes
    (["plan", "--model", "qwen3-8b", "-N", "100000000000000000000", "-P", "1", "-R", "1"],
     "-N 100000000000000000000: must be at most 1,048,576 responses per prompt"),  # 8e16 GiB
    (["mask", "--out", "m.jpg"], "--out 'm.jpg': the mask is drawn as a PNG; name a .png file"),
    # these were a traceback, a message from `dualkv` without the subcommand or the typo, and
    # "required: --model" for a misspelt --model
    (["mask", "--ragged", "--seed", "99999999999999999999", "--out", "m.png"],
     "must be in [0, 2**63)"),
    (["mask", "--grups", "2", "--out", "m.png"],
     "dualkv mask: error: unrecognized argument --grups; did you mean --groups?"),
    (["inspect", "--modle", "qwen2_5"],
     "dualkv inspect: error: unrecognized argument --modle; did you mean --model?"),
    (["plan", "--model", "qwen3-8b", "-N", "2", "-P", "3", "-R", "4", "-X"],
     "dualkv plan: error: unrecognized argument -X"),
    # an abbreviation: plan took --group for --group-size (N), inspect called it ambiguous
    (["plan", "--model", "qwen3-8b", "--group", "2", "-P", "3", "-R", "4"],
     "dualkv plan: error: unrecognized argument --group; did you mean --group-size?"),
])
def test_errors_exit_2_with_one_line(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # a relative --out lands in a writable folder
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and message in err, err
    if argv == ["bench"]:  # a name is required, the arguments after it are not
        assert err.strip().endswith("required: name"), err


def test_inspect_runs_tiny_models_past_512_positions(capsys):
    # the tiny torchtune models were built with 512 RoPE positions: 500 + 100 raised IndexError
    assert main(["inspect", "--model", "qwen2_5", "--groups", "1", "--group-size", "1",
                 "-P", "500", "-R", "100"]) == 0
    assert "attention_rewritten: 2" in capsys.readouterr().out


_LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
          "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1}


@pytest.mark.parametrize("command,content,message", [
    ("plan", [], "holds a JSON list, not an object of config fields"),
    ("plan", {**_LLAMA, "num_attention_heads": 0}, "num_attention_heads = 0 must be a positive"),
    ("plan", {**_LLAMA, "num_attention_heads": "8"}, 'num_attention_heads = "8" must be a'),
    ("plan", {**_LLAMA, "head_dim": True}, "head_dim = true must be a positive integer"),
    ("plan", {**_LLAMA, "num_key_value_heads": 3}, "is not a multiple of num_key_value_heads = 3"),
    ("inspect", {k: v for k, v in _LLAMA.items() if k != "model_type"},
     "lacks the field 'model_type'"),
    ("inspect", {**_LLAMA, "model_type": "no_such_model"}, "transformers cannot read"),
    ("inspect", {**_LLAMA, "max_position_embeddings": 8},
     "prompt + response = 12 positions, more than"),
])
def test_malformed_config_json_exits_2_with_one_line(command, content, message, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(content))
    sizes = ["-N", "1", "-P", "1", "-R", "1"] if command == "plan" else []
    assert main([command, "--model", str(path), *sizes]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_a_model_transformers_refuses_to_build_exits_2(tmp_path, capsys):
    # transformers asserts the padding id lies in the vocabulary: a traceback before (it
    # also warns on its own line, which is its logger's)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**_LLAMA, "pad_token_id": 100}))
    assert main(["inspect", "--model", str(path)]) == 2
    err = capsys.readouterr().err  # (an uncaught error would not return 2)
    assert err.strip().splitlines()[-1].startswith("dualkv inspect: error: cannot build a causal "
                                                   "LM from")


def test_inspect_a_config_json_not_named_config_json(tmp_path, capsys):
    # transformers was handed the folder, which read the folder's config.json, not this file
    (tmp_path / "llama.json").write_text(json.dumps(_LLAMA))
    assert main(["inspect", "--model", str(tmp_path / "llama.json"), "--layers", "1"]) == 0
    assert "attention_rewritten: 1" in capsys.readouterr().out


def test_out_paths_are_checked_before_the_work(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for argv, message in [
            (["mask", "--out", str(tmp_path)], f"--out {tmp_path}: is a directory; name a file"),
            (["mask", "--out", f"{a_file}/m.png"], f"{a_file} is not a directory"),
            (["inspect", "--model", "hf_llama", "--out", str(a_file)],
             f"--out {a_file}: exists and is not a directory"),
            (["inspect", "--model", "hf_llama", "--out", f"{a_file}/graphs"],
             f"{a_file} is not a directory"),
            # it wrote nothing and said nothing, exit 0
            (["inspect", "--model", "hf_llama", "--out="], "--out '': name a folder")]:
        assert main(argv) == 2
        captured = capsys.readouterr()
        assert captured.out == ""  # nothing was traced or drawn
        assert len(captured.err.strip().splitlines()) == 1 and message in captured.err, argv
    if os.path.isdir("/proc/self"):  # Linux's /proc takes no new files, even from root
        assert main(["mask", "--out", "/proc/m.png"]) == 2
        assert "--out /proc/m.png: cannot write" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine with no GPU")
def test_benchmarks_refuse_to_run_without_a_gpu(capsys):
    from dualkv_compile.tools import bench_ab, bench_attention, bench_policy_update, bench_ragged

    for module in (bench_attention, bench_policy_update):
        with pytest.raises(SystemExit) as exit_info:
            module.main(["--shapes", "2,128,128"])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err  # one line, not argparse's usage block
        assert len(err.strip().splitlines()) == 1 and "needs a CUDA GPU" in err, err
    for module in (bench_ragged, bench_ab):  # these exited 1 with a bare message
        with pytest.raises(SystemExit) as exit_info:
            module.main(["--other-dir", "/tmp"] if module is bench_ab else [])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "this benchmark needs a CUDA GPU" in err


@pytest.mark.parametrize("module", ["bench_rollout", "bench_rollout_calls"])
def test_rollout_benchmarks_refuse_to_run_without_a_gpu(module, monkeypatch, capsys):
    bench = importlib.import_module(f"dualkv_compile.tools.{module}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        bench.main([])
    assert exit_info.value.code == 2
    assert "this benchmark needs a CUDA GPU" in capsys.readouterr().err


def test_rollout_calls_prompt_lengths_must_fit_the_width(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "rollout-calls", "--shape", "4,100,8", "--prompt-lens", "50", "101"])
    assert exit_info.value.code == 2
    assert "--prompt-lens [50, 101] must lie in [1, P=100]" in capsys.readouterr().err


@pytest.mark.parametrize("caps", ["4096", "2048,x", "0,512", "1,2,3"])
def test_ragged_caps_are_checked_by_argparse_which_names_the_benchmark(caps, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "ragged", "--tiles-only", "--caps", caps, "--seeds", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dualkv bench ragged: error: argument --caps: caps '{caps}'")
    assert len(err.strip().splitlines()) == 1, err
    from dualkv_compile.tools import bench

    with pytest.raises(SystemExit):  # the module's entry point names itself
        bench.main(["ragged", "--caps", caps])
    assert capsys.readouterr().err.startswith("python -m dualkv_compile.tools.bench ragged: error")


@pytest.mark.parametrize("bench_name", ["ragged", "attention", "step", "rollout", "rollout-calls",
                                        "lm-head", "mask-forms", "linears", "ab"])
def test_a_benchmarks_out_is_checked_before_the_work(bench_name, tmp_path, capsys):
    """Before any model is built or anything timed: a missing directory, OUT.json that is a
    directory, or OUT itself a directory (OUT.json would land beside it) ends the benchmark
    with one line and exit 2."""
    (tmp_path / "x.json").mkdir()
    for out, message in [(f"{tmp_path}/missing/x", "no such directory"),
                         (f"{tmp_path}/x", "x.json: is a directory; name a file"),
                         (str(tmp_path), "is a directory; name a file stem")]:
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", bench_name, "--out", out])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"dualkv bench {bench_name}: error") and message in err, err
        assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv, message", [
    (["ragged", "--tiles-only", "--kernels", "bogus"],
     "argument --kernels: invalid choice: 'bogus'"),
    (["ragged", "--tiles-only", "--max-tokens", "0"],
     "argument --max-tokens: 0 must be at least 1"),
    (["ab", "--other-dir", "/tmp/x", "--rounds", "0"], "argument --rounds: 0 must be at least 1"),
    (["ab", "--prepare", "nosuchcommit", "--other-dir", "/tmp/x"],
     "--prepare nosuchcommit: git archive failed"),
])
def test_benchmark_arguments_are_checked_by_argparse(argv, message, capsys):
    # these were accepted (and failed later, or never), or ended in a traceback (exit 1)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["plan", "--model", "qwen3-8b", "-N", "4", "-P", "40000", "-R", "2000"],
     "-P 40000 + -R 2000 = 42000 positions, more than qwen3-8b's maximum of 40960"),
    (["inspect", "--model", "qwen2_5", "--groups", "8", "--group-size", "64", "-P", "4096",
      "-R", "4096"], "the layout packs 2,129,920 tokens, more than inspect runs on the CPU"),
])
def test_plan_and_inspect_bound_what_they_take(argv, message, capsys):
    # plan took any P + R (inspect checked it); inspect took any packed length, whose CPU run
    # grows with the square of a segment
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_closed_pipe_or_an_interrupt_ends_quietly(monkeypatch, capsys):
    from dualkv_compile.tools import plan_cmd

    for error, code in [(BrokenPipeError, 1), (KeyboardInterrupt, 130)]:
        def stopped(args, error=error):
            raise error()

        monkeypatch.setattr(plan_cmd, "run_plan", stopped)
        assert main(["plan", "--model", "qwen3-8b", "-N", "2", "-P", "3", "-R", "4"]) == code
    assert capsys.readouterr().err.strip() == "dualkv plan: interrupted"


def test_the_bench_module_entry_ends_quietly_on_a_closed_pipe(monkeypatch, capsys):
    # `python -m dualkv_compile.tools.bench --help | head -3` printed a BrokenPipeError traceback
    from dualkv_compile.tools import bench

    def closed(*args, **kwargs):
        raise BrokenPipeError

    monkeypatch.setattr(bench, "print", closed, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--help"])
    assert exit_info.value.code == 1 and capsys.readouterr().err == ""


def test_an_interrupt_python_drops_still_ends_the_command_as_interrupted(monkeypatch, capsys):
    # a KeyboardInterrupt raised inside a __del__ (as one was while transformers imported) is
    # dropped by Python: the command ran to its end and exited 0
    import os
    import signal

    from dualkv_compile.tools import plan_cmd

    class PressedInDel:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)

    def run(args):
        PressedInDel()  # collected at once: its KeyboardInterrupt is "ignored"
        print("the whole plan")
        return 0

    monkeypatch.setattr(plan_cmd, "run_plan", run)
    assert main(["plan", "--model", "qwen3-8b", "-N", "2", "-P", "3", "-R", "4"]) == 130
    assert capsys.readouterr().err.strip().endswith("dualkv plan: interrupted")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_an_interrupt_while_the_command_starts_ends_quietly(monkeypatch, capsys):
    # Ctrl-C during start-up (building the parser imports torch) is no traceback either
    from dualkv_compile.tools import cli

    def stopped():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", stopped)
    assert main(["plan"]) == 130
    assert capsys.readouterr().err.strip() == "dualkv: interrupted"


def test_the_command_module_imports_neither_torch_nor_the_models():
    # `dualkv --help` used to take 4-8 s importing the whole package at start-up
    import subprocess
    import sys

    script = ("import sys, dualkv_compile.tools.cli\n"
              "heavy = ('torch', 'torchtune', 'transformers')\n"
              "print(sorted(m for m in heavy if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_bench_ab_prepare_refuses_a_file_and_replaces_an_earlier_prepare(tmp_path, capsys):
    import subprocess

    from dualkv_compile.tools import bench_ab

    if subprocess.run(["git", "-C", os.path.dirname(bench_ab.__file__), "rev-parse", "HEAD"],
                      capture_output=True).returncode:
        pytest.skip("not a git checkout: --prepare reads the commit from git")
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit) as exit_info:
        bench_ab.main(["--prepare", "HEAD", "--other-dir", str(tmp_path / "file")])
    assert exit_info.value.code == 2
    assert "--other-dir " + str(tmp_path / "file") + ": exists and is not a directory" in (
        capsys.readouterr().err)
    stale = tmp_path / "out" / bench_ab.OTHER / "stale.py"
    stale.parent.mkdir(parents=True)
    stale.write_text("")
    bench_ab.main(["--prepare", "HEAD", "--other-dir", str(tmp_path / "out")])
    assert not stale.exists() and (stale.parent / "__init__.py").is_file()


def test_inspect_writes_its_files_before_printing(tmp_path):
    # `inspect --out DIR | head` left the reader before the files were written: none were
    from dualkv_compile.tools.cli import build_parser
    from dualkv_compile.tools.inspect_cmd import run_inspect

    printed = []

    def reader_leaves(text):
        printed.append(text)
        raise BrokenPipeError

    args = build_parser().parse_args(["inspect", "--model", "qwen2_5",
                                      "--out", str(tmp_path / "graphs")])
    with pytest.raises(BrokenPipeError):
        run_inspect(args, out=reader_leaves)
    assert len(printed) == 1 and (tmp_path / "graphs" / "attention_region.svg").is_file()


def test_inspect_out_holds_this_runs_files_only(tmp_path, capsys):
    # an earlier run's stage files and SVG stayed beside a later run's, passing for its own
    folder = tmp_path / "graphs"
    folder.mkdir()
    for name in ("9_stale.txt", "attention_region.svg"):
        (folder / name).write_text("an earlier run's")
    assert main(["inspect", "--model", "qwen2_5", "--out", str(folder)]) == 0
    assert not (folder / "9_stale.txt").exists()
    assert (folder / "attention_region.svg").read_text() != "an earlier run's"
    assert (folder / "0_traced.txt").is_file()


def test_bench_attention_takes_positive_head_counts(monkeypatch, capsys):
    # --kv-heads 0 was a ZeroDivisionError, negative counts passed
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the arguments come first
    for flag in ("--kv-heads", "--heads"):
        with pytest.raises(SystemExit) as done:
            main(["bench", "attention", flag, "0"])
        assert done.value.code == 2
        assert f"{flag}: 0 must be at least 1" in capsys.readouterr().err


def test_plan_fills_the_fields_a_config_leaves_out_as_transformers_does(tmp_path, capsys):
    # Qwen3 without head_dim / num_key_value_heads was read as 16/16 heads of 64; transformers
    # builds 8 KV heads of 128 from the same file (its Qwen3 default head_dim is 128)
    pytest.importorskip("transformers")
    cfg = dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=2, num_attention_heads=16,
               num_key_value_heads=8, intermediate_size=3072, vocab_size=1000)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", "--model", str(tmp_path), "-N", "2", "-P", "8", "-R", "4"]) == 0
    assert "16/8 heads of 128" in capsys.readouterr().out
    del cfg["num_key_value_heads"]  # transformers' Qwen3 default: 32, which 16 heads cannot use
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", "--model", str(tmp_path), "-N", "2", "-P", "8", "-R", "4"]) == 2
    assert ("num_key_value_heads = 32 (transformers' default for qwen3, which the file leaves "
            "out)") in capsys.readouterr().err

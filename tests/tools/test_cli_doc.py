"""docs/cli.md's claims about the command, checked against it: the plan example's answer,
--gpu-memory's unit, which benchmarks take `--shapes N,P,R`, and what a misspelt flag says."""

import re
from pathlib import Path

import pytest

from dualkv_compile.tools.cli import build_parser, main

DOC = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()


def test_the_documented_plan_example_shows_groups_that_fit(capsys):
    # the example was `--gpu-memory 80`, which answers "none" for Qwen3-8B (its training state
    # alone is 91.5 GiB); the doc now quotes a memory that fits, and what 80 GiB answers
    found = re.search(r"`dualkv (plan --model [^`\[\]]*--gpu-memory [\d.]+)`", DOC)
    assert found, "docs/cli.md lost its plan example with --gpu-memory"
    assert main(found.group(1).split()) == 0
    out = capsys.readouterr().out
    assert "layer checkpointing: plain 0, dualkv 2" in out and "none" not in out, out
    assert "with layer checkpointing 2 with dualkv, 0 plain" in DOC
    argv = re.sub(r"--gpu-memory [\d.]+", "--gpu-memory 80", found.group(1)).split()
    assert main(argv) == 0
    assert "in 80 GiB: none; the training state" in capsys.readouterr().out


def test_the_docs_give_gpu_memory_in_gib_as_plan_reads_it():
    # shown as GB, read as GiB (2^30 bytes)
    assert re.findall(r"--gpu-memory (G\w*)\]", DOC) == ["GiB"]
    plan = next(a for a in build_parser()._actions if a.dest == "command").choices["plan"]
    assert "GiB" in next(a for a in plan._actions if a.dest == "gpu_memory").help


def test_the_benchmarks_the_docs_name_take_shapes(capsys):
    # the doc claimed one spelling of the layout flags in every subcommand; the benchmarks take
    # N,P,R shapes, and it now names which
    found = re.search(r"`--shapes N,P,R \.\.\.` \(([^)]*)\), `--shape N,P,R` \(([^)]*)\)",
                      re.sub(r"\s+", " ", DOC))
    assert found, "docs/cli.md no longer says which benchmarks take --shapes"
    for names, flag in ((found.group(1), "--shapes N,P,R"), (found.group(2), "--shape N,P,R")):
        for name in re.findall(r"`([\w-]+)`", names):
            with pytest.raises(SystemExit) as exit_info:
                main(["bench", name, "--help"])
            assert exit_info.value.code == 0
            assert flag in capsys.readouterr().out, name


@pytest.mark.parametrize("argv, message", [
    (["bench", "attention", "--shpes", "1,128,128"],
     "dualkv bench attention: error: unrecognized argument --shpes; did you mean --shapes?"),
    (["bench", "step", "--layers", "2", "--zzz", "3"],  # no flag close to it
     "dualkv bench step: error: unrecognized argument --zzz"),
    (["mask", "-n", "4", "--out", "m.png"],
     "dualkv mask: error: unrecognized argument -n; did you mean -N?"),
])
def test_a_misspelt_flag_is_named_as_the_docs_say(argv, message, capsys):
    # a benchmark's parser said "unrecognized arguments: --shpes 1,128,128", no closest flag
    try:
        code = main(argv)
    except SystemExit as e:  # a benchmark's parser exits (bench passes its flags on)
        code = e.code
    assert code == 2
    assert capsys.readouterr().err.strip() == message
    doc = re.sub(r"\s+", " ", DOC)
    assert "`--shpes` with `--shapes`" in doc and "`-n`, with the flag of the other case, `-N`" in doc

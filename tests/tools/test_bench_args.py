"""The benchmarks' arguments: a bad value is the parser's one line naming it (exit 2) before
any model is built or anything timed, never a traceback from the middle of the work."""

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
])
def test_layout_arguments_are_parsed_before_the_work(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # never past the arguments
    err = _refused(["bench", *argv], capsys)
    assert err.startswith(f"dualkv bench {argv[0]}: error: ") and message in err, err

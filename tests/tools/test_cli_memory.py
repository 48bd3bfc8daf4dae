"""The CLI's memory checks: a model whose build would not fit this machine, and a layout whose
CPU reference attention would not, are refused before the work starts, in one line naming the
figures (the allocator's own error is a long traceback)."""

from dualkv_compile.tools.cli import main


def test_a_model_too_big_for_this_machine_is_refused_before_it_is_built(monkeypatch, capsys):
    from dualkv_compile.tools import models

    monkeypatch.setattr(models, "available_memory", lambda: 4 * 2**30)
    assert main(["inspect", "--model", "qwen3-8b"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert ("qwen3-8b with 36 layers needs about 30.8 GiB to build (30.5 GiB of fp32 weights), "
            "more than the 4.0 GiB this machine has available; use --layers 1") in err


def test_a_tied_embeddings_second_copy_counts_in_the_memory_check(monkeypatch, capsys):
    # qwen3-0.6b at 1 layer peaked at 2.2x its fp32 weights while transformers built it (the
    # LM head made, then tied): the check counted the weights alone and let it run out
    from dualkv_compile.tools import models

    monkeypatch.setattr(models, "available_memory", lambda: 1 * 2**30)
    assert main(["inspect", "--model", "qwen3-0.6b", "--layers", "1"]) == 2
    assert ("qwen3-0.6b with 1 layer needs about 1.5 GiB to build (0.6 GiB of fp32 weights and "
            "0.6 GiB for its tied embedding's second copy), more than the 1.0 GiB") in \
        capsys.readouterr().err


def test_inspect_checks_the_reference_attentions_memory_before_the_trace(monkeypatch, capsys):
    # 24,576 tokens, under the 65,536 limit, failed with an allocator traceback (38.6 GB)
    from dualkv_compile.tools import models

    monkeypatch.setattr(models, "available_memory", lambda: 16 * 2**30)
    assert main(["inspect", "--model", "qwen3-1.7b", "--layers", "1", "--groups", "1", "-N", "1",
                 "-P", "16384", "-R", "8192"]) == 2
    assert ("the CPU reference attention of qwen3-1.7b over 24,576 packed tokens holds 72.0 GiB "
            "of scores, more than the 16.0 GiB this machine has available") in \
        capsys.readouterr().err

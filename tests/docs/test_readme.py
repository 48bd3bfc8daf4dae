import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_example_runs(capsys):
    """The README's optimize() example: logprobs equal the plain model row by row; rho."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 1, "README.md lost its python example"
    code = blocks[0]
    assert 10 <= len(code.strip().splitlines()) <= 20  # the promised size
    exec(compile(code, str(README), "exec"), {})
    assert capsys.readouterr().out.split() == ["True", "1.85"]


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 250

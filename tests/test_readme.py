import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md lost its python example"
    for code in blocks:
        exec(compile(code, str(README), "exec"), {})
    assert capsys.readouterr().out.split() == ["128", "34", "1.71"]

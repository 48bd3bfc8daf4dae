import re
from pathlib import Path

API = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def test_api_example_runs(capsys):
    """docs/api.md's packing and attention example (moved from the README, same assertion)."""
    blocks = re.findall(r"```python\n(.*?)```", API.read_text(), flags=re.S)
    assert blocks, "docs/api.md lost its python example"
    for code in blocks:
        exec(compile(code, str(API), "exec"), {})
    assert capsys.readouterr().out.split() == ["128", "34", "1.71"]

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


def _brace_expand(token: str) -> list[str]:
    """`a_{x,y}.{json,md}` -> the four names, as the docs cite result files."""
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return [name for alt in m.group(1).split(",")
            for name in _brace_expand(token[:m.start()] + alt + token[m.end():])]


def test_every_result_file_is_cited():
    """docs/results/ holds only what the docs cite (issue #24): each file or folder is named,
    by its full name, its stem, or its stem with an extension pattern, in README.md or docs/."""
    docs = API.parent
    text = "\n".join(p.read_text() for p in [docs.parent / "README.md", *docs.glob("*.md")])
    cited = {name for token in re.findall(r"[\w.{},*-]+", text) for name in _brace_expand(token)}
    uncited = []
    for entry in sorted((docs / "results").iterdir()):
        stem = entry.name.split(".")[0]
        if not (entry.name in cited or stem in cited
                or any(c.startswith(stem + ".") for c in cited)):
            uncited.append(entry.name)
    assert not uncited, f"docs/results/ entries no doc cites: {uncited}"

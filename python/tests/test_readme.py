"""The README's PyTorch example runs as written and trains (its loss falls)."""
import pathlib
import re

import pytest

torch = pytest.importorskip("torch")

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def readme_example():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README.md has no python example"
    return blocks[0]


def test_readme_example_runs_and_trains(capsys):
    exec(compile(readme_example(), str(README), "exec"), {})
    out = capsys.readouterr().out
    losses = [float(v) for v in re.findall(r"step \d+: loss (\S+)", out)]
    assert len(losses) == 2, out
    assert losses[1] < losses[0] / 100, out

"""The README's examples run and print what they say."""

import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2
    scope: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for block in blocks:
            exec(compile(block, str(README), "exec"), scope)
    assert out.getvalue().strip() == "[-0.2 -0.2 -0.2] 24.0"
    assert (scope["bufs"][0] == scope["bufs"][3]).all()

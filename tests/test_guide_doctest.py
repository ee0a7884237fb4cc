"""docs/guide.md is runnable: every snippet is executed and its output compared."""

import doctest
import os

GUIDE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "guide.md")


def test_guide_snippets_run_as_written():
    result = doctest.testfile(GUIDE, module_relative=False, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 20
    assert result.failed == 0

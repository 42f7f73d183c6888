"""Every ```python block of README.md runs as written, on the 8 CPU host devices of
tests/conftest.py, both on the reference backend (what `backend="auto"` picks here) and on the
kernel route (the kernel_path fixture: the dispatch a GPU takes, with the innermost kernel
calls running the reference). The snippets check their own results (against XLA's attention,
unsharded attention, or prefill against decode).

They run in this process rather than in a subprocess each: the suite already has the 8
devices, and the kernel route needs the fixture."""
import re
from pathlib import Path

import jax
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks():
    """(line number, code) of each ```python block."""
    text = README.read_text()
    return [(text[:m.start()].count("\n") + 2, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```$", text, re.DOTALL | re.MULTILINE)]


BLOCKS = _python_blocks()


def test_readme_has_the_snippets():
    assert len(BLOCKS) >= 5, [line for line, _ in BLOCKS]


@pytest.mark.parametrize("route", ["reference", "kernel"])
@pytest.mark.parametrize("line, code", BLOCKS, ids=[f"line{line}" for line, _ in BLOCKS])
def test_readme_snippet_runs(line, code, route, request):
    assert jax.device_count() == 8  # the multi-device snippets assume the suite's 8 devices
    if route == "kernel":
        request.getfixturevalue("kernel_path")
    exec(compile(code, f"{README}:{line}", "exec"), {"__name__": "readme_snippet"})

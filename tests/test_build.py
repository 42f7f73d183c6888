"""The build and the documented commands: CI must run the README's test command, and a build
made where nvcc exists must contain the kernels, registered for the jaxlib in use."""
import re
import shutil
from pathlib import Path

import jax
import pytest

import tk_jax
from tk_jax import _ext

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands():
    return re.findall(r"```\n(python3 -m pip install .*?)\n```", (ROOT / "README.md").read_text())


def test_ci_runs_the_readme_test_command():
    commands = _readme_commands()
    assert len(commands) == 2, commands  # demo, tests
    demo, tests = commands
    assert demo.endswith("python3 -m tk_jax demo")
    assert tests.endswith("python3 -m pytest -q")
    ci_lines = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    assert tests in ci_lines


def test_info_reports_versions_and_kernel_state():
    info = tk_jax.info()
    assert info["jax"] == jax.__version__
    assert isinstance(info["kernels_available"], bool)
    if not info["kernels_available"]:
        assert info["kernels_unavailable_reason"]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA toolkit: the package builds without kernels")
def test_extension_was_built_with_kernels_for_this_jaxlib():
    import jaxlib

    build = _ext.build_info()
    assert build["have_kernels"], build["why_no_kernels"]
    assert build["cuda_archs"] == "sm_90a"
    assert build["built_against_jaxlib"] == jaxlib.__version__
    ok, why = _ext.kernels_available()  # registering CUDA targets works on any jaxlib
    assert ok, why
    from tk_jax import _tk

    assert {"tk_attention_fwd", "tk_attention_bwd"} <= set(_tk.registrations())


def test_require_cuda_is_documented_and_used_in_ci():
    assert "TK_JAX_REQUIRE_CUDA=1" in (ROOT / ".ci/run").read_text()
    assert "TK_JAX_REQUIRE_CUDA" in (ROOT / "CMakeLists.txt").read_text()

"""The build and the documented commands: CI runs the README's test command; a build either
makes the kernels or fails saying why (a reference-only install happens only when asked for);
a build made where nvcc exists holds the kernels, built against FFI headers no newer than the
jaxlib in use."""
import functools
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import jax
import pytest

import tk_jax
from tk_jax import _ext

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands():
    return re.findall(r"```\n(python3 -m pip install .*?)\n```", (ROOT / "README.md").read_text())


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.match(r"\d+(\.\d+)*", text).group(0).split("."))


def test_ci_runs_the_readme_test_command():
    commands = _readme_commands()
    assert len(commands) == 2, commands  # demo, tests
    demo, tests = commands
    assert demo.endswith("python3 -m tk_jax demo")
    assert tests.endswith("python3 -m pytest -q")
    ci_lines = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    assert tests in ci_lines


def test_build_uses_the_ffi_headers_of_the_oldest_supported_jaxlib():
    """XLA accepts handlers built against older FFI headers only: the isolated build's jaxlib
    must be the oldest one the package declares it runs with."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    build_jaxlib = [r for r in project["build-system"]["requires"] if r.startswith("jaxlib")]
    assert len(build_jaxlib) == 1 and build_jaxlib[0].startswith("jaxlib=="), build_jaxlib
    oldest_jax = [r for r in project["project"]["dependencies"] if re.match(r"jax\b(?!lib)", r)]
    assert len(oldest_jax) == 1, oldest_jax
    lower_bound = re.search(r">=\s*([0-9.]+)", oldest_jax[0]).group(1)
    assert build_jaxlib[0] == f"jaxlib=={lower_bound}"


def test_info_reports_versions_and_kernel_state():
    info = tk_jax.info()
    assert info["jax"] == jax.__version__
    assert isinstance(info["kernels_available"], bool)
    if not info["kernels_available"]:
        assert info["kernels_unavailable_reason"]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA toolkit: nothing was built here")
def test_extension_was_built_with_kernels_for_this_jaxlib():
    import jaxlib

    build = _ext.build_info()
    assert build["have_kernels"], build["why_no_kernels"]
    assert build["cuda_archs"] == "sm_90a"
    assert re.fullmatch(r"\d+\.\d+", build["xla_ffi_api"]), build
    if build["built_against_jaxlib"]:  # empty when the headers came from TK_JAX_FFI_INCLUDE_DIR
        assert _version(build["built_against_jaxlib"]) <= _version(jaxlib.__version__), build
    ok, why = _ext.kernels_available()  # registering CUDA targets works on any jaxlib
    assert ok, why
    from tk_jax import _tk

    assert {"tk_attention_fwd", "tk_attention_bwd"} <= set(_tk.registrations())


@functools.cache
def _cmake() -> str | None:
    """A cmake as new as the build asks for (pyproject's cmake.version): the one the test
    extra installs (the cmake package), else the one on PATH; None if neither is."""
    minimum = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["scikit-build"][
        "cmake"]["version"].removeprefix(">=")
    try:
        import cmake
        candidates = [os.path.join(cmake.CMAKE_BIN_DIR, "cmake")]
    except ImportError:
        candidates = []
    candidates += [c for c in [shutil.which("cmake")] if c]
    for candidate in candidates:
        out = subprocess.run([candidate, "--version"], capture_output=True, text=True).stdout
        found = re.search(r"version (\d+(\.\d+)*)", out)
        if found and _version(found.group(1)) >= _version(minimum):
            return candidate
    return None


def _configure(tmp_path, **env):
    """Run CMake's configure step of the package (no compiling) with extra environment."""
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    return subprocess.run(
        [_cmake(), "-S", str(ROOT), "-B", str(tmp_path / "build"), *generator,
         f"-DPython_EXECUTABLE={sys.executable}"],
        env={**os.environ, **env}, capture_output=True, text=True)


@pytest.mark.skipif(_cmake() is None or shutil.which("c++") is None,
                    reason="needs a C++ compiler and cmake as new as the build asks for")
def test_build_without_cuda_compiler_fails_and_names_the_reference_only_switch(tmp_path):
    result = _configure(tmp_path, CUDACXX="/nonexistent/nvcc")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "no CUDA compiler found" in output
    assert "TK_JAX_REFERENCE_ONLY=1" in output
    assert not (tmp_path / "build" / "_build_info.py").exists()


@pytest.mark.skipif(_cmake() is None or shutil.which("c++") is None,
                    reason="needs a C++ compiler and cmake as new as the build asks for")
def test_reference_only_build_on_purpose_records_why(tmp_path):
    result = _configure(tmp_path, CUDACXX="/nonexistent/nvcc", TK_JAX_REFERENCE_ONLY="1")
    assert result.returncode == 0, result.stdout + result.stderr
    build_info = {}
    exec((tmp_path / "build" / "_build_info.py").read_text(), build_info)
    assert build_info["have_kernels"] is False
    assert "TK_JAX_REFERENCE_ONLY=1" in build_info["why_no_kernels"]

"""The package as users see it: its version, its public names, its type information."""
from __future__ import annotations

import inspect
import pathlib
import re

import tk_jax

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_version_matches_pyproject():
    pyproject = (ROOT / "pyproject.toml").read_text()
    declared = re.search(r'^version\s*=\s*"([^"]+)"', pyproject, re.MULTILINE)
    assert declared, "no version in pyproject.toml"
    assert tk_jax.__version__ == declared.group(1)


def test_public_functions_are_exported_and_typed():
    for name in tk_jax.__all__:
        function = getattr(tk_jax, name)
        signature = inspect.signature(function)
        untyped = [p for p in signature.parameters.values()
                   if p.annotation is inspect.Parameter.empty]
        assert not untyped, f"tk_jax.{name}: parameters without a type hint: {untyped}"
        assert signature.return_annotation is not inspect.Signature.empty, name


def test_package_declares_type_information():
    assert (pathlib.Path(tk_jax.__file__).parent / "py.typed").is_file()

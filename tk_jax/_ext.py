"""Loading the compiled extension and registering its FFI targets with XLA (once)."""
from __future__ import annotations

import functools
import importlib

import jax


_BUILD_INFO_KEYS = ("have_kernels", "why_no_kernels", "built_against_jaxlib", "xla_ffi_headers",
                    "xla_ffi_api", "cuda_archs")


def build_info() -> dict:
    """What the build recorded: whether kernels were compiled and if not why, the XLA FFI
    headers they were compiled against (a jaxlib version, or the TK_JAX_FFI_INCLUDE_DIR path) and
    their FFI API version, the CUDA architectures."""
    try:
        from tk_jax import _build_info as b
    except ImportError:
        return {"have_kernels": False, "why_no_kernels": "package not built (no _build_info)",
                **{key: "" for key in _BUILD_INFO_KEYS[2:]}}
    return {key: getattr(b, key, "") for key in _BUILD_INFO_KEYS}


@functools.lru_cache(maxsize=None)
def _register(module_name: str) -> tuple[bool, str]:
    try:
        module = importlib.import_module(f"tk_jax.{module_name}")
    except ImportError as err:
        why = build_info()["why_no_kernels"] or f"cannot import tk_jax.{module_name}: {err}"
        return False, why
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    return True, ""


def kernels_available() -> tuple[bool, str]:
    """(True, "") when the kernel extension is loaded and its targets registered."""
    return _register("_tk")


def test_kernels_available() -> tuple[bool, str]:
    """Same for the kittens unit-test kernels (tk_jax._tk_tests)."""
    return _register("_tk_tests")

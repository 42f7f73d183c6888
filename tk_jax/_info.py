"""tk_jax.info(): what is installed and whether the compiled kernels can run here.

Meant for bug reports and for a first check after installing: it never raises, it records
what went wrong instead.
"""
from __future__ import annotations

import importlib.metadata

import jax

from tk_jax import _backend, _ext


def _distribution_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _jaxlib_version() -> str:
    version = _distribution_version("jaxlib")
    if version == "unknown":
        try:
            import jaxlib.version
            version = jaxlib.version.__version__
        except ImportError:
            pass
    return version


def _default_device() -> str:
    try:
        device = jax.devices()[0]
    except RuntimeError as err:
        return f"none ({err})"
    kind = getattr(device, "device_kind", "")
    return f"{device.platform}: {kind}" if kind else device.platform


def _extension_build_info() -> dict:
    """How the compiled extension was built (archs, jaxlib it was built against), or why unknown."""
    try:  # a broken install must still produce a report
        return dict(_ext.build_info())
    except Exception as err:
        return {"error": f"build_info() failed: {type(err).__name__}: {err}"}


def _kernel_unavailable_reason() -> str | None:
    try:
        return _backend.kernel_unavailable_reason()
    except Exception as err:
        return f"could not check: {type(err).__name__}: {err}"


def info() -> dict:
    """Versions, extension build details and kernel availability, as a plain dict.

    Keys: tk_jax, jax, jaxlib, default_device, extension (dict), kernels_available (bool),
    kernels_unavailable_reason (str, or None when the kernels are available).
    Print it readably with tk_jax._info.format_info(info()) or `python -m tk_jax info`.
    """
    reason = _kernel_unavailable_reason()
    return {
        "tk_jax": _distribution_version("tk_jax"),
        "jax": jax.__version__,
        "jaxlib": _jaxlib_version(),
        "default_device": _default_device(),
        "extension": _extension_build_info(),
        "kernels_available": reason is None,
        "kernels_unavailable_reason": reason,
    }


def format_info(report: dict) -> str:
    """The dict from info() as aligned `key: value` lines; nested dicts are indented."""
    lines = []

    def add(mapping, indent):
        width = max((len(str(key)) for key in mapping), default=0)
        for key, value in mapping.items():
            if isinstance(value, dict):
                lines.append(f"{indent}{key}:")
                add(value, indent + "  ")
            else:
                if isinstance(value, (list, tuple)):
                    value = ", ".join(str(item) for item in value)
                lines.append(f"{indent}{str(key) + ':':<{width + 1}} {value}")

    add(report, "")
    return "\n".join(lines)


def print_info() -> None:
    print(format_info(info()))

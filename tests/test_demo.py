"""`python -m tk_jax demo` checks every op against its own naive float64 computation: it passes
here (the reference on CPU, ring attention over the 8 host devices of tests/conftest.py) and it
fails, saying which op and exiting non-zero, when an op is wrong."""
import re

import jax
import pytest

import tk_jax
from tk_jax import __main__ as cli
from tk_jax._backend import kernel_unavailable_reason


def _errors(line: str) -> dict:
    """{"o": 2.3e-07, "dq": ...} from a demo line."""
    return {name: float(value) for name, value in re.findall(r"(\w+) (\d\.\de[+-]\d+)", line)}


OPS = ("flash_attention", "ring_attention", "based_linear_attention", "based_decode_step")


def test_demo_checks_every_op_and_passes(capsys):
    backend = "reference" if kernel_unavailable_reason() else "kernel"
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    lines = {op: [line for line in out.splitlines() if line.startswith(op)] for op in OPS}
    for op, found in lines.items():
        assert len(found) == 1, (op, out)
        assert found[0].endswith(" ok") and f" {backend} " in found[0], found[0]
    assert "ring_attention (8 device(s))" in out
    assert "FAIL" not in out and out.rstrip().endswith("all ok")


@pytest.mark.parametrize("wrong", ["output", "gradient", "raises"])
def test_demo_fails_when_an_op_is_wrong(capsys, monkeypatch, wrong):
    real = tk_jax.flash_attention

    def broken_attention(q, k, v, **options):
        if wrong == "raises":
            raise RuntimeError("broken on purpose")
        if wrong == "output":
            return real(q, k, v, **options) * 1.01
        # The same output, but dq 1% too large: q's value with 1.01 times its gradient.
        return real(q + 0.01 * (q - jax.lax.stop_gradient(q)), k, v, **options)

    monkeypatch.setattr(tk_jax, "flash_attention", broken_attention)
    monkeypatch.setattr(cli, "CHECKS", (cli.check_flash_attention, cli.check_based_decode_step))
    assert cli.main(["demo"]) == 1
    lines = capsys.readouterr().out.splitlines()
    attention = next(line for line in lines if line.startswith("flash_attention"))
    assert "FAIL" in attention, lines
    if wrong == "gradient":  # the output still passes, dq alone is caught
        errors = _errors(attention)
        assert errors["o"] < 1e-4 < errors["dq"], attention
    decode = next(line for line in lines if line.startswith("based_decode_step"))
    assert decode.endswith(" ok"), lines  # the other ops are still checked
    assert lines[-1] == "FAILED"

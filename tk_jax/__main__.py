"""Command line: `python -m tk_jax info` and `python -m tk_jax demo`.

demo runs a short jitted forward + backward of flash_attention and based_linear_attention on
the best backend available here, and compares outputs and gradients with the float32 reference.
(Benchmarks live in `python -m tk_jax.bench`.)
"""
from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp

# bf16 accuracy criterion of the design: relative L2 error of outputs and gradients vs float32.
TOLERANCE = 1e-2


def relative_l2(actual, expected) -> float:
    actual = jnp.asarray(actual, jnp.float32)
    expected = jnp.asarray(expected, jnp.float32)
    norm = jnp.linalg.norm(expected)
    diff = jnp.linalg.norm(actual - expected)
    return float(diff / norm) if float(norm) > 0 else float(diff)


def forward_backward(fn, inputs, cotangent):
    """Jitted output and input gradients of `fn` for the given output cotangent."""
    def run(inputs, cotangent):
        out, pullback = jax.vjp(fn, *inputs)
        return out, pullback(cotangent)
    return jax.jit(run)(inputs, cotangent)


def compare_with_reference(title, make_fn, inputs, names, dtype) -> bool:
    """Run make_fn(backend) on the best backend and on the float32 reference; print errors."""
    cotangent_key = jax.random.PRNGKey(1)
    inputs = tuple(x.astype(dtype) for x in inputs)
    # Try the kernel first; the API raises ValueError (while tracing) saying why it can't run.
    backend, why = "kernel", ""
    out_shape = jax.eval_shape(make_fn("reference"), *inputs)
    cotangent = jax.random.normal(cotangent_key, out_shape.shape, jnp.float32).astype(dtype)
    try:
        out, grads = forward_backward(make_fn("kernel"), inputs, cotangent)
    except ValueError as err:
        backend, why = "reference", f" (kernel not used: {err})"
        out, grads = forward_backward(make_fn("reference"), inputs, cotangent)
    inputs32 = tuple(x.astype(jnp.float32) for x in inputs)
    ref_out, ref_grads = forward_backward(make_fn("reference"), inputs32,
                                          cotangent.astype(jnp.float32))

    print(f"{title}: backend={backend}{why}")
    ok = True
    for name, actual, expected in zip(["output"] + [f"d{n}" for n in names],
                                      (out,) + tuple(grads), (ref_out,) + tuple(ref_grads)):
        error = relative_l2(actual, expected)
        ok &= error < TOLERANCE
        verdict = "ok" if error < TOLERANCE else f"FAIL (> {TOLERANCE:g})"
        print(f"  {name:<7} relative L2 error vs float32 reference: {error:.2e}  {verdict}")
    return ok


def demo() -> int:
    on_gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    print(f"device: {jax.devices()[0]}, dtype: {jnp.dtype(dtype).name}")
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    batch, seq, heads = 2, 256, 4

    from tk_jax.attention import flash_attention
    q, k, v = (jax.random.normal(key, (batch, seq, heads, 64), jnp.float32) for key in keys[:3])

    def attention_fn(backend):
        return functools.partial(flash_attention, causal=True, backend=backend)

    ok = compare_with_reference("flash_attention (B=2, T=256, H=4, D=64, causal)",
                                attention_fn, (q, k, v), "qkv", dtype)

    try:
        from tk_jax.linear_attention import based_linear_attention
    except ImportError as err:
        print(f"based_linear_attention: skipped, not importable yet ({err})")
        return 0 if ok else 1
    # Based's feature dimension is 16; small q, k keep the Taylor feature map in a sane range.
    q, k = (0.5 * jax.random.normal(key, (batch, seq, heads, 16), jnp.float32)
            for key in keys[3:5])
    v = jax.random.normal(keys[5], (batch, seq, heads, 64), jnp.float32)

    def based_fn(backend):
        return functools.partial(based_linear_attention, backend=backend)

    ok &= compare_with_reference("based_linear_attention (B=2, T=256, H=4, feature 16, Dv=64)",
                                 based_fn, (q, k, v), "qkv", dtype)
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tk_jax", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="versions, extension build and kernel availability")
    commands.add_parser("demo", help="jitted forward+backward of each op, checked against the "
                                     "float32 reference")
    args = parser.parse_args(argv)
    if args.command == "info":
        from tk_jax._info import format_info, info
        print(format_info(info()))
        return 0
    return demo()


if __name__ == "__main__":
    sys.exit(main())

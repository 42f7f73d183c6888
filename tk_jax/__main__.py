"""Command line: `python -m tk_jax info` and `python -m tk_jax demo`.

demo runs every op once, jitted, forward and backward, on the backend `backend="auto"` picks
here, and checks outputs and gradients against a naive float64 NumPy computation written out
below from the math (independent of tk_jax.reference). It prints the backend, the error and
ok/FAIL per op, and exits with status 1 if any check fails.
(Benchmarks live in `python -m bench`.)
"""
from __future__ import annotations

import argparse
import functools
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

import tk_jax

# Largest relative L2 error of an output or gradient against float64. bf16: the accuracy
# criterion of the design (typically ~2e-3); float32 (the CPU demo): rounding only.
TOLERANCE = {"bfloat16": 1e-2, "float32": 1e-4}


def relative_l2(actual, expected) -> float:
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    norm = np.linalg.norm(expected)
    diff = np.linalg.norm(actual - expected)
    return float(diff / norm) if norm > 0 else float(diff)


# ------------------------------------------------------------------------------------------
# Naive float64 computations: arrays [B, T, H, X] as in the API, moved to [B, H, T, X] inside.

def _heads_first(x):
    return np.swapaxes(np.asarray(x, np.float64), 1, 2)


def naive_attention(q, k, v, do, *, causal: bool):
    """Softmax attention and its gradients: (o, dq, dk, dv) for output cotangent do."""
    q, k, v, do = map(_heads_first, (q, k, v, do))
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = q @ np.swapaxes(k, -1, -2) * scale
    if causal:
        scores = np.where(np.tril(np.ones(scores.shape[-2:], bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    o = p @ v
    dv = np.swapaxes(p, -1, -2) @ do
    dp = do @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))   # softmax's Jacobian
    dq = ds @ k * scale
    dk = np.swapaxes(ds, -1, -2) @ q * scale
    return tuple(np.swapaxes(x, 1, 2) for x in (o, dq, dk, dv))


def naive_based(q, k, v, dy, *, eps: float):
    """Normalised causal Based attention, y_t = sum_j a_tj v_j / (sum_j a_tj + eps) with
    a_tj = 1 + s + s^2/2, s = q_t.k_j / sqrt(d), j <= t; returns (y, dq, dk, dv)."""
    q, k, v, dy = map(_heads_first, (q, k, v, dy))
    scale = 1.0 / math.sqrt(q.shape[-1])
    causal = np.tril(np.ones((q.shape[-2], k.shape[-2])))
    s = q @ np.swapaxes(k, -1, -2) * scale
    a = (1.0 + s + 0.5 * s * s) * causal
    num = a @ v
    den = a.sum(axis=-1, keepdims=True) + eps
    y = num / den
    dnum = dy / den
    dden = -(dy * y).sum(axis=-1, keepdims=True) / den
    da = dnum @ np.swapaxes(v, -1, -2) + dden
    dv = np.swapaxes(a, -1, -2) @ dnum
    ds = da * (1.0 + s) * causal
    dq = ds @ k * scale
    dk = np.swapaxes(ds, -1, -2) @ q * scale
    return tuple(np.swapaxes(x, 1, 2) for x in (y, dq, dk, dv))


def taylor_features(x):
    """phi(x) = [1, x / d^(1/4), vec(x x^T) / (sqrt(2) sqrt(d))], so phi(q).phi(k) = 1 + s + s^2/2."""
    x = np.asarray(x, np.float64)
    d = x.shape[-1]
    outer = (x[..., :, None] * x[..., None, :]).reshape(x.shape[:-1] + (d * d,))
    return np.concatenate([np.ones(x.shape[:-1] + (1,)), x / d**0.25,
                           outer / (math.sqrt(2.0) * math.sqrt(d))], axis=-1)


def naive_based_decode(q_t, k_t, v_t, state_s, state_z, *, eps: float):
    """One recurrent step: S += phi(k_t) v_t^T, z += phi(k_t), y_t = phi(q_t) S / (phi(q_t).z + eps)."""
    phi_k, phi_q = taylor_features(k_t), taylor_features(q_t)
    state_s = np.asarray(state_s, np.float64) + phi_k[..., :, None] * np.asarray(v_t, np.float64)[..., None, :]
    state_z = np.asarray(state_z, np.float64) + phi_k
    y = np.einsum("...f,...fv->...v", phi_q, state_s) / (
        np.einsum("...f,...f->...", phi_q, state_z)[..., None] + eps)
    return y, state_s, state_z


# ------------------------------------------------------------------------------------------
# Running an op and judging it.

def run_jitted(fn, *args):
    """fn(*args) compiled, and "kernel" if the compiled program calls a tk_jax kernel (an XLA
    FFI target named tk_*), else "reference"."""
    compiled = jax.jit(fn).lower(*args).compile()
    backend = "kernel" if 'custom_call_target="tk_' in compiled.as_text() else "reference"
    return compiled(*args), backend


def output_and_grads(fn, inputs, cotangent):
    """Jitted output of fn and the gradients of <output, cotangent> in every input."""
    def run(inputs, cotangent):
        out, pullback = jax.vjp(fn, *inputs)
        return out, pullback(cotangent)
    (out, grads), backend = run_jitted(run, inputs, cotangent)
    return (out,) + tuple(grads), backend


def report(title, backend, named_results, tolerance) -> bool:
    """Print one op's errors against the naive computation; True when all are within tolerance."""
    errors = {name: relative_l2(actual, expected) for name, actual, expected in named_results}
    ok = all(error <= tolerance for error in errors.values())  # NaN fails
    details = "  ".join(f"{name} {error:.1e}" for name, error in errors.items())
    print(f"{title:<34} {backend:<9} {details}  {'ok' if ok else f'FAIL (> {tolerance:g})'}")
    return ok


def random_inputs(rng, dtype, *shapes, scale=1.0):
    """Standard normal arrays (times scale) of the given shapes, in dtype."""
    return tuple(jnp.asarray(scale * rng.standard_normal(shape), dtype) for shape in shapes)


def check_flash_attention(rng, dtype, tolerance) -> bool:
    batch, seq, heads, dim = 2, 256, 4, 64
    q, k, v, do = random_inputs(rng, dtype, *[(batch, seq, heads, dim)] * 4)
    results, backend = output_and_grads(
        functools.partial(tk_jax.flash_attention, causal=True), (q, k, v), do)
    expected = naive_attention(q, k, v, do, causal=True)
    return report("flash_attention (causal)", backend,
                  zip(["o", "dq", "dk", "dv"], results, expected), tolerance)


def check_ring_attention(rng, dtype, tolerance) -> bool:
    """Ring attention over all local devices (a ring of one on a single device)."""
    devices = jax.devices()
    batch, seq, heads, dim = 2, 64 * len(devices), 4, 64
    q, k, v, do = random_inputs(rng, dtype, *[(batch, seq, heads, dim)] * 4)
    mesh = Mesh(np.array(devices), ("seq",))
    split = PartitionSpec(None, "seq")
    ring = jax.shard_map(
        functools.partial(tk_jax.ring_attention, axis_name="seq", causal=True, load_balanced=False),
        mesh=mesh, in_specs=split, out_specs=split)
    results, backend = output_and_grads(ring, (q, k, v), do)
    expected = naive_attention(q, k, v, do, causal=True)
    return report(f"ring_attention ({len(devices)} device(s))", backend,
                  zip(["o", "dq", "dk", "dv"], results, expected), tolerance)


def check_based_linear_attention(rng, dtype, tolerance) -> bool:
    batch, seq, heads, value_dim = 2, 256, 4, 64
    eps = 1e-6
    # Small q, k keep the Taylor map's weights 1 + s + s^2/2 in a sensible range.
    q, k = random_inputs(rng, dtype, *[(batch, seq, heads, 16)] * 2, scale=0.5)
    v, dy = random_inputs(rng, dtype, *[(batch, seq, heads, value_dim)] * 2)
    results, backend = output_and_grads(
        functools.partial(tk_jax.based_linear_attention, eps=eps), (q, k, v), dy)
    expected = naive_based(q, k, v, dy, eps=eps)
    return report("based_linear_attention", backend,
                  zip(["y", "dq", "dk", "dv"], results, expected), tolerance)


def check_based_decode_step(rng, dtype, tolerance) -> bool:
    batch, prefix, heads, value_dim = 2, 32, 4, 64
    eps = 1e-6
    q_t, k_t, k_prefix = random_inputs(rng, dtype, (batch, heads, 16), (batch, heads, 16),
                                       (batch, prefix, heads, 16), scale=0.5)
    v_t, v_prefix = random_inputs(rng, dtype, (batch, heads, value_dim),
                                  (batch, prefix, heads, value_dim))
    # The state after a prefix, from its definition: S = sum_j phi(k_j) v_j^T, z = sum_j phi(k_j).
    phi_k = taylor_features(k_prefix)
    state_s = np.einsum("bthf,bthv->bhfv", phi_k, np.asarray(v_prefix, np.float64))
    state_z = phi_k.sum(axis=1)
    state = (jnp.asarray(state_s, jnp.float32), jnp.asarray(state_z, jnp.float32))
    (y_t, (new_s, new_z)), backend = run_jitted(
        functools.partial(tk_jax.based_decode_step, eps=eps), q_t, k_t, v_t, state)
    expected = naive_based_decode(q_t, k_t, v_t, state[0], state[1], eps=eps)
    return report("based_decode_step", backend,
                  zip(["y_t", "S", "z"], (y_t, new_s, new_z), expected), tolerance)


CHECKS = (check_flash_attention, check_ring_attention, check_based_linear_attention,
          check_based_decode_step)


def demo() -> int:
    from tk_jax._backend import kernel_unavailable_reason

    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    tolerance = TOLERANCE[jnp.dtype(dtype).name]
    why_not = kernel_unavailable_reason()
    print(f"device: {jax.devices()[0]}, dtype: {jnp.dtype(dtype).name}, kernels: "
          + ("available" if why_not is None else f"not used here ({why_not})"))
    print(f"relative L2 error of each output and gradient against naive float64 NumPy "
          f"(tolerance {tolerance:g}):")
    rng = np.random.default_rng(0)
    ok = True
    for check in CHECKS:
        title = check.__name__.removeprefix("check_")
        try:
            ok &= check(rng, dtype, tolerance)
        except Exception as err:  # report every op, then fail
            print(f"{title:<34} FAIL: {type(err).__name__}: {err}")
            ok = False
    print("all ok" if ok else "FAILED")
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tk_jax", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="versions, extension build and kernel availability")
    commands.add_parser("demo", help="each op, jitted forward and backward, checked against a "
                                     "naive float64 computation")
    args = parser.parse_args(argv)
    if args.command == "info":
        from tk_jax._info import format_info, info
        print(format_info(info()))
        return 0
    return demo()


if __name__ == "__main__":
    sys.exit(main())

"""Based linear attention's outputs and final state under many seeds, on the kernel backend.

Runs one case (by default the one an H100 acceptance run once saw return a z with an inf:
fp16, B=2, H=3, T=777, Dv=64, normalize=False, return_state=True) with fresh random inputs per
seed, into memory poisoned with NaN, and checks that every output (y, S, z; with --path kernel
also the normaliser den) is finite and matches the float32 reference backend (matmuls at full
precision). --sweep adds the neighbours: T +-1 and +56, both dtypes, normalised or not, with
and without return_state and an initial state, the sequence split as dispatched and forced
into 4 groups. Prints the failures, then one summary line; exits 1 on any failure.

  python3 scripts/based_state_check.py --seeds 500
  python3 scripts/based_state_check.py --sweep --seeds 10
  XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform \\
    compute-sanitizer --tool initcheck --error-exitcode 3 \\
    python3 scripts/based_state_check.py --seeds 2 --no-reference
  (the same with --tool racecheck)
"""
from __future__ import annotations

import argparse
import functools
import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import tk_jax
from tk_jax import _ext, _kernels, _sequence_split
from tk_jax.linear_attention import FEATURE_DIM, NUM_FEATURES

DTYPES = {"fp16": jnp.float16, "bf16": jnp.bfloat16}
# Over these a case fails (those of tests/test_based_gpu.py): z is summed exactly in fp32.
TOLERANCES = {"y": 1e-2, "S": 1e-2, "z": 1e-4, "den": 1e-2}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=200, help="runs per case (default 200)")
    p.add_argument("--first-seed", type=int, default=None,
                   help="seed of the first run (default: fresh); run i uses first + i")
    p.add_argument("--dtype", choices=DTYPES, default="fp16")
    p.add_argument("--b", type=int, default=2)
    p.add_argument("--h", type=int, default=3)
    p.add_argument("--t", type=int, default=777)
    p.add_argument("--dv", type=int, default=64)
    p.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--return-state", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--initial-state", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--split", type=int, default=0,
                   help="force the sequence split into this many groups (default: as dispatched)")
    p.add_argument("--path", choices=("api", "kernel"), default="api",
                   help="api: based_linear_attention; kernel: the forward kernel's wrapper alone")
    p.add_argument("--sweep", action="store_true", help="the case's neighbours too")
    p.add_argument("--no-reference", action="store_true",
                   help="check finiteness only (for the sanitizer: fewer kernels of XLA's)")
    return p.parse_args()


def cases(args):
    """The cases to run, as dicts of the case's settings."""
    base = dict(dtype=args.dtype, b=args.b, h=args.h, t=args.t, dv=args.dv, normalize=args.normalize,
                return_state=args.return_state, initial_state=args.initial_state, split=args.split,
                path=args.path)
    if not args.sweep:
        return [base]
    out = []
    for t, dtype, normalize, return_state, initial_state, split in itertools.product(
            (args.t - 1, args.t, args.t + 1, args.t + 56), DTYPES, (False, True), (True, False),
            (False, True), (0, 4)):
        out.append(dict(base, t=t, dtype=dtype, normalize=normalize, return_state=return_state,
                        initial_state=initial_state, split=split))
    return out


def describe(case) -> str:
    return (f"{case['path']} {case['dtype']} B{case['b']} H{case['h']} T{case['t']} Dv{case['dv']} "
            f"normalize={case['normalize']} return_state={case['return_state']} "
            f"initial_state={case['initial_state']} split={case['split'] or 'auto'}")


def random_case(rng, case):
    """q, k, v in the case's dtype and an initial state (None without one) that earlier
    tokens could have left, so that the normaliser stays positive."""
    b, t, h, dv = case["b"], case["t"], case["h"], case["dv"]
    dtype = DTYPES[case["dtype"]]
    q, k = (jnp.asarray(rng.standard_normal((b, t, h, FEATURE_DIM)), dtype) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((b, t, h, dv)), dtype)
    if not case["initial_state"]:
        return q, k, v, None
    k0 = jnp.asarray(rng.standard_normal((b, 40, h, FEATURE_DIM)), jnp.float32)
    v0 = jnp.asarray(rng.standard_normal((b, 40, h, dv)), jnp.float32)
    _, state = tk_jax.based_linear_attention(k0, k0, v0, return_state=True, backend="reference")
    return q, k, v, tuple(state)


def poison(nbytes: int) -> None:
    """Fill then free a NaN buffer: the next outputs get memory that holds NaN."""
    jnp.full((max(nbytes // 4, 1),), jnp.nan, jnp.float32).block_until_ready()


def runner(case):
    """A jitted fn(q, k, v, state) -> dict of the outputs to check."""
    normalize, return_state = case["normalize"], case["return_state"]
    if case["path"] == "kernel":
        def run(q, k, v, state):
            if state is None:
                batch, _, heads, value_dim = v.shape
                state = (jnp.zeros((batch, heads, NUM_FEATURES, value_dim), jnp.float32),
                         jnp.zeros((batch, heads, NUM_FEATURES), jnp.float32))
            y, s, z, den = _kernels.based_fwd(q, k, v, *state, normalize=normalize, eps=1e-6)
            return {"y": y, "S": s, "z": z, "den": den}
    else:
        def run(q, k, v, state):
            out = tk_jax.based_linear_attention(q, k, v, normalize=normalize, initial_state=state,
                                                return_state=return_state, backend="kernel")
            if not return_state:
                return {"y": out}
            y, (s, z) = out
            return {"y": y, "S": s, "z": z}
    return jax.jit(run)


@functools.partial(jax.jit, static_argnames="normalize")
def _reference(q, k, v, state, normalize):
    return tk_jax.based_linear_attention(q, k, v, normalize=normalize, initial_state=state,
                                         return_state=True, backend="reference")


def reference(q, k, v, state, normalize: bool) -> dict:
    """The float32 reference backend, matmuls at full precision (no TF32)."""
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    with jax.default_matmul_precision("highest"):
        y, (s, z) = _reference(*f32, state, normalize=normalize)
        # den, the normaliser without eps: the unnormalised output for a value column of ones.
        ones = jnp.ones(v.shape[:-1] + (1,), jnp.float32)
        z_only = None if state is None else (state[1][..., None], state[1])
        den, _ = _reference(f32[0], f32[1], ones, z_only, normalize=False)
    return {"y": y, "S": s, "z": z, "den": jnp.swapaxes(den[..., 0], 1, 2)}


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check(got: dict, want: dict | None, worst: dict) -> list[str]:
    """Sentences on what is wrong; updates worst[name] with the largest relative error."""
    problems = []
    for name, x in got.items():
        x = np.asarray(x.astype(jnp.float32))
        bad = ~np.isfinite(x)
        if bad.any():
            first = np.argwhere(bad)[:3].tolist()
            problems.append(f"{name}: {int(bad.sum())} non-finite, first at {first}, e.g. {x[tuple(first[0])]}")
        elif want is not None:
            err = rel_l2(x, want[name])
            worst[name] = max(worst.get(name, 0.0), err)
            if err >= TOLERANCES[name]:
                problems.append(f"{name}: rel. error {err:.2e}")
    return problems


def main() -> int:
    args = parse_args()
    ok, why = _ext.kernels_available()
    if not ok:
        print(f"based_state_check: the kernels are not available: {why}")
        return 2
    first_seed = args.first_seed if args.first_seed is not None else int(np.random.SeedSequence().entropy % 2**31)
    all_cases = cases(args)
    runs = failures = non_finite = 0
    worst: dict = {}
    real_num_groups = _sequence_split.num_groups
    for case in all_cases:
        # The dispatch reads num_groups while tracing, so a forced split needs its own trace.
        _sequence_split.num_groups = (lambda *a, g=case["split"]: g) if case["split"] else real_num_groups
        run = runner(case)
        for i in range(args.seeds):
            seed = first_seed + i
            q, k, v, state = random_case(np.random.default_rng(seed), case)
            poison(8 * v.nbytes + 8 * case["b"] * case["h"] * NUM_FEATURES * (case["dv"] + 1))
            got = run(q, k, v, state)
            want = None if args.no_reference else reference(q, k, v, state, case["normalize"])
            problems = check(got, want, worst)
            runs += 1
            if problems:
                failures += 1
                non_finite += any("non-finite" in p for p in problems)
                print(f"FAIL {describe(case)} seed={seed}: " + "; ".join(problems), flush=True)
    _sequence_split.num_groups = real_num_groups
    what = describe(all_cases[0]) if len(all_cases) == 1 else f"{len(all_cases)} cases around {describe(all_cases[0])}"
    errors = " ".join(f"{name} {err:.1e}" for name, err in sorted(worst.items()))
    print(f"based_state_check: {runs} runs ({args.seeds} seeds from {first_seed} x {what}): "
          f"{failures} failed ({non_finite} with non-finite values)"
          + (f"; worst rel. error {errors}" if errors else "")
          + f"; {jax.devices()[0].device_kind}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

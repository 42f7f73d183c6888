"""One attention kernel call of a bench grid shape, after warm-up, for a profiler such as ncu:

    ncu -k regex:backward --launch-skip 2 -c 1 python3 scripts/profile_case.py --d 256 --t 4k

The shape follows the bench grid (B * T = 16384 tokens, Hq * D = 2048); random bf16 inputs.
`--pass fwd` profiles the forward kernel, `bwd` (the default) the backward's. Warm-up runs
the same call twice first, so skip those launches (`--launch-skip 2` above).

`--contender cudnn` (or any bench contender, e.g. fa3) runs that contender's jitted forward,
or forward and backward, three times instead, to profile a peer's kernels beside ours:

    ncu -k regex:bprop --launch-skip 2 -c 1 python3 scripts/profile_case.py --contender cudnn

`--jitted` does the same for tk_jax: the bench's jitted call, so that the profile holds every
kernel of the step (the backward's row statistics and dq passes too), as a training step runs
them."""
import argparse
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from tk_jax import _ext, _kernels
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the checkout's bench/
from bench import Runner, attention, parse_int_list, prepare_runner

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--d", type=int, default=128)
parser.add_argument("--t", type=parse_int_list, default=[4096], help="sequence length, e.g. 4096 or 4k")
parser.add_argument("--causal", action="store_true")
parser.add_argument("--pass", dest="which", choices=["fwd", "bwd"], default="bwd")
parser.add_argument("--contender", default="tk",
                    help="tk (our kernels, called directly) or a bench contender name, e.g. cudnn")
parser.add_argument("--jitted", action="store_true",
                    help="with --contender tk: the bench's jitted call (every kernel of the step)")
args = parser.parse_args()
configs = attention.make_configs(args.t[:1], (args.d,), (args.causal,), (args.which == "bwd",))
if not configs:
    parser.error(f"T={args.t[0]}, D={args.d} is not a bench grid shape")

if args.contender != "tk" or args.jitted:
    named = {c.name: c for c in attention.contenders("kernel")}
    if args.contender not in named:
        parser.error(f"--contender: unknown {args.contender!r}; the bench knows {sorted(named)}")
    runner = prepare_runner(named[args.contender], configs[0], verbose_errors=True)
    if not isinstance(runner, Runner):
        parser.error(f"--contender {args.contender}: {': '.join(runner)}")
    for i in range(3):  # two warm-up calls, then the profiled one
        runner.clock.sync(runner.call(i % runner.n_sets))
    print(f"profiled: {args.contender} {configs[0].label()}")
    raise SystemExit(0)

ok, why = _ext.kernels_available()
assert ok, why
t, batch, heads = configs[0].t, configs[0].batch, configs[0].heads
rng = np.random.default_rng()
q, k, v, dout = (jnp.asarray(rng.standard_normal((batch, t, heads, args.d)), jnp.bfloat16) for _ in range(4))
kw = dict(scale=1 / math.sqrt(args.d), window_left=-1, window_right=0 if args.causal else -1)
o, lse = _kernels.attention_fwd(q, k, v, **kw)
for _ in range(2 if args.which == "fwd" else 3):  # two warm-up calls (with the one above), then the profiled one
    if args.which == "fwd":
        jax.block_until_ready(_kernels.attention_fwd(q, k, v, **kw))
    else:
        jax.block_until_ready(_kernels.attention_bwd(q, k, v, o, lse, dout, **kw))
print(f"profiled: {args.which} D={args.d} T={t} B={batch} H={heads} causal={args.causal}")

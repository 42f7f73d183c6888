"""CUDA graphs (XLA command buffers) around the kernels' FFI handlers.

The handlers declare ffi::Traits::kCmdBufferCompatible, so XLA may record a jitted step's
custom calls into a CUDA graph and replay it (re-recording when buffer addresses change)
instead of calling the handlers every step. This test shows that this happens and is safe: a
jitted step with attention and Based forward and backward (T = 300, not a multiple of 64) and
a Based decode step, and the attention backward in three calls (a dQ state handed from call
to call), compiled with command buffers for custom calls,
  1. runs every tk_* custom call inside a command buffer, and
  2. gives, over three calls on fresh inputs (new values at new addresses each time), what the
     same step compiled without command buffers gives: forward outputs bit for bit, gradients
     to within rounding (attention's dq adds its partial sums with float atomics).

XLA_FLAGS are read once, when JAX starts its backend, so the graph side runs in a fresh
subprocess started with the command-buffer flags (so the handlers' first calls there, which
set kernel attributes and look up the tensor-map encoder, can happen during stream capture).
The reference side runs here, with command buffers switched off for its one compilation
(XLA's defaults already allow custom calls in command buffers).
"""
import glob
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tk_jax
from gpu_util import rel_l2

pytestmark = pytest.mark.gpu

B, T, H, D, DV = 2, 300, 4, 128, 64  # attention head dim D; Based feature dim 16, value dim DV
GRAPH_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
TARGETS = ["tk_attention_bwd", "tk_attention_bwd_dq", "tk_attention_bwd_keys",
           "tk_attention_bwd_row_stats", "tk_attention_fwd", "tk_based_bwd", "tk_based_decode",
           "tk_based_fwd"]
SHAPES = {"q": (B, T, H, D), "k": (B, T, H, D), "v": (B, T, H, D), "w_o": (B, T, H, D),
          "qf": (B, T, H, 16), "kf": (B, T, H, 16), "vb": (B, T, H, DV), "w_y": (B, T, H, DV),
          "qt": (B, H, 16), "kt": (B, H, 16), "vt": (B, H, DV)}
FORWARD = ("o", "y", "y_t")
OUTPUTS = FORWARD + ("dq", "dk", "dv", "dqf", "dkf", "dvb", "dq_state", "dk_state")
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def cmdbuf_step(q, k, v, w_o, qf, kf, vb, w_y, qt, kt, vt):
    """Attention and Based forward, the gradients of a weighted sum of their outputs, and one
    Based decode step from the final state."""
    def loss(q, k, v, qf, kf, vb):
        o = tk_jax.flash_attention(q, k, v, causal=True, backend="kernel")
        y, state = tk_jax.based_linear_attention(qf, kf, vb, return_state=True, backend="kernel")
        total = jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(y.astype(jnp.float32) * w_y)
        return total, (o, y, state)

    grads, (o, y, state) = jax.grad(loss, argnums=tuple(range(6)), has_aux=True)(
        q, k, v, qf, kf, vb)
    y_t, _ = tk_jax.based_decode_step(qt, kt, vt, state, backend="kernel")
    return (o, y, y_t, *grads, *backward_in_three_calls(q, k, v, w_o))


def backward_in_three_calls(q, k, v, do):
    """(dq, dk of the first keys) from the backward's three calls (one dQ state handed from
    call to call, the kernel call's state aliased in and out), the keys in two blocks."""
    from tk_jax import _kernels

    kw = dict(scale=1 / D ** 0.5, window_left=-1, window_right=-1)
    o, lse = _kernels.attention_fwd(q, k, v, **kw)
    state = _kernels.attention_bwd_row_stats(o, lse, do, scale=kw["scale"])
    state, dk, _ = _kernels.attention_bwd_keys(state, q, k[:, :T // 2], v[:, :T // 2], do,
                                               dq_rows=T, dq_row_shift=0, **kw)
    state, _, _ = _kernels.attention_bwd_keys(state, q, k[:, T // 2:], v[:, T // 2:], do,
                                              dq_rows=T, dq_row_shift=0, **kw)
    return _kernels.attention_bwd_dq(state, q), dk


def random_inputs(rng):
    """Host inputs, float32: the weights w_o, w_y, and bf16 values for the rest."""
    inputs = {name: rng.standard_normal(shape, np.float32) for name, shape in SHAPES.items()}
    return {name: x if name.startswith("w_") else x.astype(jnp.bfloat16).astype(np.float32)
            for name, x in inputs.items()}


def on_device(inputs):
    return [jnp.asarray(inputs[name], jnp.float32 if name.startswith("w_") else jnp.bfloat16)
            for name in SHAPES]


def graph_side(out_dir, seed):
    """The subprocess: compile with command buffers, check that they hold our custom calls,
    call three times on fresh inputs and save inputs and outputs to out_dir/call{i}.npz."""
    example = on_device(random_inputs(np.random.default_rng(seed)))
    compiled = jax.jit(cmdbuf_step).lower(*example).compile()
    check_in_command_buffers(compiled.as_text(), os.path.join(out_dir, "dump"))
    alive = []  # every call's buffers stay allocated, so the next call's get new addresses
    for i in range(3):
        inputs = random_inputs(np.random.default_rng([seed, i + 1]))
        args = on_device(inputs)
        outputs = compiled(*args)
        alive.append((args, outputs))
        np.savez(os.path.join(out_dir, f"call{i}.npz"), **inputs,
                 **{name: np.asarray(x.astype(jnp.float32)) for name, x in zip(OUTPUTS, outputs)})


def check_in_command_buffers(hlo, dump_dir):
    """Every tk_* custom call of the compiled step runs inside a command buffer."""
    targets = re.findall(r'custom_call_target="(tk_\w+)"', hlo)
    assert sorted(set(targets)) == TARGETS, hlo
    # XLA before thunk-level conversion outlines command buffers in the compiled HLO, as
    # computations named command_buffer*.
    buffers = [body for name, body in computations(hlo).items() if "command_buffer" in name]
    if buffers:
        inside = re.findall(r'custom_call_target="(tk_\w+)"', "".join(buffers))
        assert sorted(inside) == sorted(targets), f"tk_* calls outside command buffers:\n{hlo}"
        return
    # Current XLA forms command buffers from the thunk sequence when it builds the executable,
    # after the HLO: only the dump of that sequence shows them.
    dumps = sorted(glob.glob(os.path.join(dump_dir, "*thunk_sequence_after_thunk_passes*")))
    listing = os.listdir(dump_dir) if os.path.isdir(dump_dir) else "(no dump directory)"
    assert dumps, f"no command buffer: none in the HLO, no thunk dump in {listing}\n{hlo}"
    thunks = "".join(open(path).read() for path in dumps)
    inside, outside = custom_call_thunks(thunks)
    assert outside == 0 and inside >= len(targets), (
        f"{inside} custom-call thunks inside command buffers, {outside} outside, "
        f"{len(targets)} tk_* custom calls:\n{thunks}\n{hlo}")


def computations(hlo):
    """{name: body} of the computations in HLO text."""
    bodies, name = {}, None
    for line in hlo.splitlines():
        if name is None:
            header = re.match(r"(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
            if header:
                name = header.group(1)
                bodies[name] = ""
        elif line.startswith("}"):
            name = None
        else:
            bodies[name] += line + "\n"
    return bodies


def custom_call_thunks(dump):
    """(inside, outside): kCustomCall thunks nested in a kCommandBuffer thunk and not, read off
    the indentation of XLA's thunk-sequence dump (lines like "  012: kCustomCall ...")."""
    inside = outside = 0
    open_buffers = []  # indents of the enclosing kCommandBuffer lines
    for line in dump.splitlines():
        thunk = re.match(r"(\s*)(?:[^\sk]\S*\s+)?(k[A-Z]\w*)", line)
        if not thunk:
            continue
        indent, kind = len(thunk.group(1)), thunk.group(2)
        while open_buffers and indent <= open_buffers[-1]:
            open_buffers.pop()
        if kind == "kCustomCall":
            inside, outside = (inside + 1, outside) if open_buffers else (inside, outside + 1)
        elif kind == "kCommandBuffer":
            open_buffers.append(indent)
    return inside, outside


def test_command_buffers_match_plain_execution(hopper, rng, tmp_path):
    seed = int(rng.integers(2**31))
    env = dict(os.environ)  # the same PYTHONPATH; XLA_FLAGS extended
    env["XLA_FLAGS"] = " ".join(filter(None, [
        env.get("XLA_FLAGS"), GRAPH_FLAGS, f"--xla_dump_to={tmp_path / 'dump'}",
        "--xla_dump_hlo_module_re=cmdbuf_step"]))
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"   # really compile (and dump)
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # this process preallocated most GPU memory
    code = (f"import sys; sys.path.insert(0, {TESTS_DIR!r}); import test_command_buffer_gpu as t; "
            f"t.graph_side({str(tmp_path)!r}, {seed})")
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           timeout=600)
    assert child.returncode == 0, (f"graph side failed (exit {child.returncode}):\n"
                                   f"{child.stdout[-20000:]}\n{child.stderr[-50000:]}")

    plain = None
    for i in range(3):
        saved = np.load(tmp_path / f"call{i}.npz")
        args = on_device(saved)
        if plain is None:
            plain = jax.jit(cmdbuf_step).lower(*args).compile(
                compiler_options={"xla_gpu_enable_command_buffer": ""})  # no command buffers
        for name, want in zip(OUTPUTS, plain(*args)):
            got, want = saved[name], np.asarray(want.astype(jnp.float32))
            assert np.isfinite(got).all() and np.abs(want).max() > 0, (i, name)
            if name in FORWARD:  # the forward kernels are deterministic
                np.testing.assert_array_equal(got, want, err_msg=f"call {i}: {name}")
            else:
                # Attention's dq adds per-key-block partial sums with float atomics, in any
                # order: rounded to bf16, a few elements may differ by one step.
                tol = 1e-4 if name in ("dq", "dq_state") else 1e-5
                assert rel_l2(got, want) <= tol, (f"call {i}: {name}", rel_l2(got, want))

"""Several processes, one JAX runtime: 2 processes x 4 CPU host devices on localhost, joined by
jax.distributed.initialize (as on two hosts), run batch/head-sharded attention, ring attention,
flash_attention on a sequence-sharded input and a data-parallel BasedLM training step
(tests/multiprocess_worker.py); the results must equal those of this one process over its 8
host devices. CPU collectives between processes go through gloo (jax 0.10's default for
jax.distributed on CPU; the worker sets it anyway)."""
from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import numpy as np

import tk_jax._kernels

try:  # tests/ as a package, or tests/ on sys.path
    from tests import multiprocess_worker
    from tests.cp_util import dense_kernels_module
except ImportError:
    import multiprocess_worker
    from cp_util import dense_kernels_module

TESTS = pathlib.Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_match_one(tmp_path, rng, install_kernels):
    seed = int(rng.integers(2**31))
    port, out = _free_port(), tmp_path / "results.npz"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)] + [
                   p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    workers = [subprocess.Popen([sys.executable, str(TESTS / "multiprocess_worker.py"),
                                 str(port), "2", str(i), str(seed), str(out)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
               for i in range(2)]
    try:
        # Meanwhile, the same in this process over its 8 host devices.
        install_kernels(dense_kernels_module(tk_jax._kernels))
        expected = multiprocess_worker.compute_all(seed)
        logs = [w.communicate(timeout=240)[0] for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    for i, (w, log) in enumerate(zip(workers, logs)):
        assert w.returncode == 0, f"process {i} failed:\n{log[-4000:]}"
    got = dict(np.load(out))
    assert set(got) == set(expected)
    for name, value in expected.items():
        # Gathers and permutes move exact values; only sums over devices (the LM's gradient
        # all-reduce, dK/dV of split heads) may add in another order.
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)

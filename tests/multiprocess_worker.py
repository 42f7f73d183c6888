"""The sharded computations of tests/test_multiprocess.py, run either in one process over its 8
host devices or as one of several processes joined by jax.distributed (then over the devices of
all of them, as on several hosts):

    python3 tests/multiprocess_worker.py PORT NUM_PROCESSES PROCESS_ID SEED OUT.npz

(the parent sets XLA_FLAGS for 4 host devices per process and JAX_PLATFORMS=cpu). Process 0
writes the results, gathered to the host, to OUT.npz. The attention calls take the kernel path
with the dense stand-in of tests/cp_util.py (the partitioning rules, the ring and the
sequence-sharded program run as on GPUs); the language model runs the reference.
"""
from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def _put(x, mesh, spec):
    """A global array from the same host data in every process (each takes its shards)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])


def _to_host(tree):
    return jax.tree.map(lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)),
                        tree)


def _outputs_and_grads(attend):
    def run(q, k, v, do):
        def loss(q, k, v):
            return jnp.sum(attend(q, k, v).astype(jnp.float32) * do)
        return attend(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    return jax.jit(run)


def compute_all(seed: int) -> dict:
    """Every computation's outputs, as host arrays, by name."""
    import tk_jax

    rng = np.random.default_rng(seed)
    devices = np.array(jax.devices())
    assert devices.size == 8, devices
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    out = {}

    # 1. Batch and heads split (GQA, the kv heads split with the query heads).
    mesh = Mesh(devices.reshape(2, 4), ("data", "model"))
    q, do = normal(4, 16, 8, 16), normal(4, 16, 8, 16)
    k, v = normal(4, 16, 4, 16), normal(4, 16, 4, 16)
    spec = P("data", None, "model")
    run = _outputs_and_grads(functools.partial(tk_jax.flash_attention, causal=True,
                                               backend="kernel"))
    o, grads = _to_host(run(*(_put(x, mesh, spec) for x in (q, k, v, do))))
    out.update(batch_heads_o=o, batch_heads_dq=grads[0], batch_heads_dk=grads[1],
               batch_heads_dv=grads[2])

    # 2. Ring attention over 4 devices that span both processes (devices 0, 2, 4, 6 and
    # 1, 3, 5, 7; the batch split over the other axis), in the load-balanced layout, and 3.
    # flash_attention on a sequence-sharded input: the same inputs, the same results.
    mesh = Mesh(devices.reshape(4, 2), ("seq", "data"))
    seq = P("data", "seq")
    q, k, v, do = (normal(2, 32, 2, 16) for _ in range(4))
    ring = jax.shard_map(functools.partial(tk_jax.ring_attention, axis_name="seq", causal=True,
                                           backend="kernel"),
                         mesh=mesh, in_specs=(seq, seq, seq), out_specs=seq)
    balanced = [np.asarray(tk_jax.to_load_balanced(jnp.asarray(x), 4)) for x in (q, k, v, do)]
    o, grads = _to_host(_outputs_and_grads(ring)(*(_put(x, mesh, seq) for x in balanced)))
    back = lambda x: np.asarray(tk_jax.from_load_balanced(jnp.asarray(x), 4))  # noqa: E731
    out.update(ring_o=back(o), ring_dq=back(grads[0]), ring_dk=back(grads[1]),
               ring_dv=back(grads[2]))
    run = _outputs_and_grads(functools.partial(tk_jax.flash_attention, causal=True,
                                               backend="kernel"))
    o, grads = _to_host(run(*(_put(x, mesh, seq) for x in (q, k, v, do))))
    out.update(sequence_o=o, sequence_dq=grads[0], sequence_dk=grads[1], sequence_dv=grads[2])

    # 4. A data-parallel training step of a small BasedLM: batch split, parameters replicated.
    out.update(_lm_step(rng, Mesh(devices, ("data",))))
    return out


def _lm_step(rng, mesh) -> dict:
    from flax import nnx

    from tk_jax.nn import BasedConfig, BasedLM

    config = BasedConfig(vocab_size=32, d_model=32, num_layers=1, layer_pattern=("based",),
                         based_heads=2, backend="reference")
    graphdef, params = nnx.split(BasedLM(config, rngs=nnx.Rngs(0)), nnx.Param)

    def loss_fn(params, tokens):
        logits = nnx.merge(graphdef, params)(tokens[:, :-1]).astype(jnp.float32)
        labels = jax.nn.one_hot(tokens[:, 1:], config.vocab_size)
        return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * labels, axis=-1))

    @jax.jit
    def step(params, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    params = jax.tree.map(lambda x: _put(x, mesh, P()), params)
    tokens = _put(rng.integers(0, config.vocab_size, (8, 9)).astype(np.int32), mesh, P("data"))
    new_params, loss = step(params, tokens)
    leaves = jax.tree.leaves(new_params)
    return {"lm_loss": _to_host(loss), **{f"lm_param_{i}": _to_host(leaf)
                                         for i, leaf in enumerate(leaves)}}


def main(argv) -> int:
    port, num_processes, process_id, seed, out_path = argv
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}",
                               num_processes=int(num_processes), process_id=int(process_id))
    assert jax.process_count() == int(num_processes) and jax.local_device_count() == 4

    from cp_util import install_dense_kernels

    install_dense_kernels()
    results = compute_all(int(seed))
    if jax.process_index() == 0:
        np.savez(out_path, **results)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

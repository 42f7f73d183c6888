"""Helpers shared by the CPU and GPU sharding tests."""
import re

import jax
import jax.numpy as jnp

COLLECTIVES = re.compile(r"\b(all-gather|all-to-all|all-reduce|collective-permute|"
                         r"reduce-scatter)(-start)?\b")


def collectives(compiled_text: str) -> set[str]:
    """The kinds of collective in a compiled program's HLO text."""
    return {m.group(1) for m in COLLECTIVES.finditer(compiled_text)}


def output_and_grads(attend):
    """fn(q, k, v, do) -> (o, (dq, dk, dv)) of the loss sum(o * do)."""
    def run(q, k, v, do):
        def loss(q, k, v):
            return jnp.sum(attend(q, k, v).astype(jnp.float32) * do)
        return attend(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    return run

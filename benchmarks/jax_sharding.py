"""Data-parallel JAX training step on 1 vs 2 devices at the same per-device batch.

One process with two host CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=2``,
set here before JAX starts). A step is ``jax.value_and_grad`` of a Tensor
Memory layer's loss plus an SGD update, under ``jit``: on one device with
batch ``b``, and on both with batch ``2 b`` sharded along the batch over an
Auto mesh (parameters replicated); and on one device with batch ``2 b``. With
a device per core set, ideal scaling keeps the step time equal (twice the
work on twice the devices); host devices share the machine's cores, so the
one-device step at batch ``2 b`` (same work, same cores) is the fair
reference there. The fused CPU kernels are split along the batch, so no device
waits for a gathered batch (``all_gathers`` counts them in the compiled step). Rows with
``native=False`` time the generic path for comparison. Prints one JSON line and
writes it to ``--out``.

    python -m benchmarks.jax_sharding --config lm-256 --reps 7 --one-core-per-device \\
        --out benchmarks/results/jax_sharding_1core.json
"""

from __future__ import annotations

import os
import sys

_ONE_CORE = "--one-core-per-device" in sys.argv
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2"
                           + (" --xla_cpu_multi_thread_eigen=false" if _ONE_CORE else "")).strip()
if _ONE_CORE:  # each host device computes on one thread: a device per core
    os.environ["OMP_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402

from benchmarks.common import CONFIGS, TINY, machine_line, time_fn  # noqa: E402

__all__ = ["main"]


def _step_timer(cfg, devices: int, native: bool, reps: int, batch: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import tmcore
    from tmcore.adapters import jax as tmj

    params = tmj.init(jax.random.key(0), cfg.embed_dim, cfg.channels, cfg.shape, cfg.chunk)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(batch, cfg.tokens, cfg.embed_dim)), jnp.float32)
    target = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
    if devices > 1:
        mesh = jax.make_mesh((devices,), ("data",), axis_types=(AxisType.Auto,))
        x = jax.device_put(x, NamedSharding(mesh, P("data")))
        target = jax.device_put(target, NamedSharding(mesh, P("data")))
        params = jax.device_put(params, NamedSharding(mesh, P()))

    def loss(p, x_, t):
        out, _ = tmj.apply(p, x_)
        return jnp.mean((out - t) ** 2)

    with tmcore.options(native=native):
        @jax.jit
        def step(p, x_, t):
            value, grads = jax.value_and_grad(loss)(p, x_, t)
            return value, jax.tree.map(lambda a, g: a - 1e-3 * g, p, grads)

        compiled = step.lower(params, x, target).compile()
    gathers = compiled.as_text().count("all-gather(")
    timing = time_fn(lambda: jax.block_until_ready(compiled(params, x, target)), reps,
                     warmup=2)
    return {"devices": devices, "native": native, "batch": batch, "all_gathers": gathers,
            **timing}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="lm-256",
                        choices=[c.name for c in [*CONFIGS, TINY]])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--one-core-per-device", action="store_true",
                        help="one compute thread per host device (XLA and the C kernels), so "
                             "two devices use two cores and one device one core")
    args = parser.parse_args(argv)
    cfg = next(c for c in [*CONFIGS, TINY] if c.name == args.config)
    # one device at the per-device batch, one device at the combined batch (the same
    # work as the two-device step on the same cores), two devices at the combined batch
    rows = [_step_timer(cfg, devices, native, args.reps, batch)
            for native in (True, False)
            for devices, batch in ((1, cfg.batch), (1, 2 * cfg.batch), (2, 2 * cfg.batch))]
    result = {
        "command": "python -m benchmarks.jax_sharding " + " ".join(argv or sys.argv[1:]),
        "config": cfg.name, "describe": f"per device: {cfg.describe()}",
        "machine": machine_line(), "load_average": os.getloadavg(),
        "one_core_per_device": args.one_core_per_device, "rows": rows,
    }
    line = json.dumps(result)
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

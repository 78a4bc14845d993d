"""Local updates vs the dense step: ms per chunk step and peak memory, grid 8^3 to 64^3.

One chunk step (read, write, ConvLSTM update) on torch CPU, float32, one thread, at a
fixed window (``w = 4`` cells per axis, so the box is 6^3 at every grid), B = 4, C = 16:

- ``dense``: the dense scan's own step (``tmcore.scan.step_fwd``): the write and the
  update cover the whole grid;
- ``local (generic)``: one step of ``tmcore.local_memory_scan(..., overwrite_state=True)``
  (fast method) on tmcore's generic loop, under ``tmcore.options(native=False)`` (the
  torch ops per step, ~350 of them): read 2^3 cells, splat and update the 6^3 box, write
  it back in place;
- ``local (fused)``: the same call with the default options, which on the CPU takes the
  torch backend's fused local scan (``backends/torch/local.py``: C kernels per step, one
  torch op);
- ``local (copy)``: ``tmcore.local_update`` (fast path; the write and update, no read),
  which returns a new state and so copies it once per call (a memory copy of
  ``2 B C prod(S)`` floats, no arithmetic);
- ``local vjp (generic)`` / ``local vjp (fused)``: a chunk scan of 8 steps forward
  (``tmcore.scan.local.local_scan_fwd``, the undo-log residuals) and backward
  (``local_scan_bwd``), as the layer runs them, per step (the call / 8), with the
  options of the two rows above; per call the forward copies the state and the
  backward the two state cotangents once (``O(B C prod(S))``, no arithmetic).

Torch ops per step (``ops_per_step`` in the JSON; a ``TorchDispatchMode`` counter, the
ops of a 6-step scan minus a 2-step one, / 4, at the smallest grid), forward
(``local_memory_scan``'s) and backward (``local_scan_bwd``), generic and fused.

Peak memory: per grid a fresh process (``run_isolated``, glibc's mmap threshold pinned so
freed buffers go back to the system) measures, per method, the growth of the resident
set's high-water mark over one step after a warm-up (``peak_rss_growth``), the state
itself allocated before. Time per step: per method a fresh process with the ordinary
allocator runs one step at each grid in turn (so the load of a shared machine falls on
every grid alike) until each grid has at least 3 steps and ``--min-seconds`` per grid
have passed; the minimum over the steps is reported (the median is kept too). Writes
``benchmarks/results/local_update.json``
(``command``, ``commit``, ``machine``, ``config``, ``rows``) and
``benchmarks/results/local_update.md`` (the table)::

    python -m benchmarks.local_update            # about 1 to 2 minutes
    python -m benchmarks.local_update --tiny     # seconds, no files

``--layer`` measures the layer's options instead (:mod:`tmcore.scan.warped`): the layer's
scan over ``--steps`` chunks (read, [warp by a shift of 0.1], write, update;
``tmcore.memory_scan`` for the default) per option, forward and forward + backward, per
chunk step, same sizes, every option timed at every grid in turn in one process;
writes ``benchmarks/results/layer_options.json`` and ``.md``::

    python -m benchmarks.local_update --layer --grids 8 16 32 --min-seconds 0.5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
METHODS = ("dense", "local (generic)", "local (fused)", "local (copy)", "local vjp (generic)",
           "local vjp (fused)")
#: Steps per call of the ``vjp`` rows (their times are per step: the call / this).
VJP_STEPS = 8

__all__ = ["measure", "table", "main"]


def _inputs(torch, batch: int, channels: int, grid: int, seed: int = 0):
    import tmcore

    g = torch.Generator().manual_seed(seed)
    shape = (grid, grid, grid)
    h = torch.randn(batch, channels, *shape, generator=g) * 0.5
    c = torch.randn(batch, channels, *shape, generator=g) * 0.5
    coords = torch.rand(batch, 2, 3, generator=g) * 1.8 - 0.9
    sigma = torch.full((batch,), 2.0 / (grid - 1))  # one cell
    content = torch.randn(batch, channels, generator=g)
    params = tmcore.ConvParams(torch.randn(3, 2 * channels, 3, generator=g) * 0.5,
                               torch.randn(3, 2 * channels, generator=g) * 0.1,
                               torch.randn(4 * channels, 2 * channels, generator=g) * 0.2,
                               torch.zeros(4 * channels))
    return h, c, coords[:, 0], coords[:, 1], sigma, content, params


def _scan_inputs(torch, h, c, sigma, params, steps: int, seed: int = 1):
    """A chunk scan of ``steps`` steps on the state ``h, c``: ``(args, (g_reads, g_h,
    g_c))`` for ``tmcore.local_memory_scan_vjp``."""
    g = torch.Generator().manual_seed(seed)
    batch, channels = h.shape[:2]
    lead = (batch, steps)
    args = (h, c, torch.rand(*lead, 3, generator=g) * 1.8 - 0.9,
            torch.rand(*lead, 3, generator=g) * 1.8 - 0.9,
            sigma[:, None].expand(lead).contiguous(),
            torch.randn(*lead, channels, generator=g), params)
    return args, (torch.randn(*lead, channels, generator=g), torch.ones_like(h),
                  torch.ones_like(c))


def count_ops(grid: int, batch: int, channels: int, window: int) -> dict:
    """Torch ops per chunk step of the local scan, generic (``native=False``) and fused:
    ``{"generic": {"fwd", "bwd"}, "fused": {...}}``, the ops of a 6-step scan minus a
    2-step one, / 4 (the once-per-call setup cancels)."""
    import contextlib

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import tmcore
    from tmcore.scan import local as local

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    h, c, _, _, sigma, _, params = _inputs(torch, batch, channels, grid)
    xp = tmcore.runtime.validate.namespace_of(h=h)

    def ops(steps: int, generic: bool) -> tuple[int, int]:
        args, cotangents = _scan_inputs(torch, h, c, sigma, params, steps)
        with tmcore.options(native=False) if generic else contextlib.nullcontext():
            for _ in range(2):  # the second time counted: builds, caches and the buffer
                # pool (whose hits and misses differ by a few ops) as in a steady loop
                with Count() as fwd:
                    out = local.local_scan_fwd(xp, *args, window=window)
                with Count() as bwd:
                    local.local_scan_bwd(xp, out[3], *args[2:], *cotangents, window=window)
                del out
        return fwd.ops, bwd.ops

    result = {}
    with torch.no_grad():
        for name, generic in (("generic", True), ("fused", False)):
            few, many = ops(2, generic), ops(6, generic)
            result[name] = {"fwd": (many[0] - few[0]) / 4, "bwd": (many[1] - few[1]) / 4}
    return result


def _timed(fn, min_seconds: float, max_reps: int) -> dict:
    """Warm up once, then repeat until ``min_seconds`` have passed (3 to ``max_reps``)."""
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_seconds
                             and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"ms_min": 1e3 * times[0], "ms_median": 1e3 * times[len(times) // 2],
            "reps": len(times)}


def _steps_per_call(method: str) -> int:
    return VJP_STEPS if method.startswith("local vjp") else 1


def _step(method: str, grid: int, batch: int, channels: int, window: int):
    """The chunk step of ``method`` at ``grid`` as a closure over fresh inputs (the ``vjp``
    rows: a call of :data:`VJP_STEPS` steps)."""
    import contextlib

    import torch

    import tmcore
    from tmcore.scan import local as local
    from tmcore.scan import step_fwd
    from tmcore.types import StepInputs

    h, c, read, write, sigma, content, params = _inputs(torch, batch, channels, grid)
    xp = tmcore.runtime.validate.namespace_of(h=h)
    options = ((lambda: tmcore.options(native=False)) if method.endswith("(generic)")
               else contextlib.nullcontext)
    if method == "dense":
        inputs = StepInputs(read, write, sigma, content)

        def step():
            return step_fwd(xp, h, c, inputs, params, 1e-6, None)
    elif method in ("local (generic)", "local (fused)"):
        reads, writes = read[:, None], write[:, None]
        sigmas, contents = sigma[:, None], content[:, None]

        def step():
            with options():
                return tmcore.local_memory_scan(h, c, reads, writes, sigmas, contents, params,
                                                window=window, overwrite_state=True)
    elif method.startswith("local vjp"):
        args, cotangents = _scan_inputs(torch, h, c, sigma, params, VJP_STEPS)

        def step():
            with options():
                *_, residuals = local.local_scan_fwd(xp, *args, window=window)
                return local.local_scan_bwd(xp, residuals, *args[2:], *cotangents,
                                            window=window)
    else:
        def step():
            return tmcore.local_update(h, c, write, sigma, content, params, window=window)
    return step


def measure(method: str, grid: int, batch: int, channels: int, window: int,
            min_seconds: float, timing: bool = True) -> dict:
    """One method at one grid, in this process: ``{"ms_min", "ms_median", "reps",
    "peak_rss_growth_bytes"}`` (without the timing keys when ``timing`` is false)."""
    import torch

    from benchmarks.common import peak_rss_growth

    torch.set_num_threads(1)
    step = _step(method, grid, batch, channels, window)
    with torch.no_grad():
        row = _timed(step, min_seconds, 200) if timing else {}
        per = _steps_per_call(method)
        for key in ("ms_min", "ms_median"):
            if key in row:
                row[key] /= per
        step()  # warm-up before the memory measurement
        row["peak_rss_growth_bytes"] = peak_rss_growth(step)
    return row


def measure_interleaved(method: str, grids: list[int], batch: int, channels: int,
                        window: int, min_seconds: float) -> dict:
    """Time ``method`` at every grid in one process, one step per grid in turn, so that
    a busy machine slows every grid alike; ``{grid: {"ms_min", "ms_median", "reps"}}``."""
    import torch

    torch.set_num_threads(1)
    steps = {g: _step(method, g, batch, channels, window) for g in grids}
    times: dict[int, list[float]] = {g: [] for g in grids}
    with torch.no_grad():
        for step in steps.values():
            step()
        start = time.perf_counter()
        while (min(len(t) for t in times.values()) < 3
               or time.perf_counter() - start < min_seconds * len(grids)) \
                and len(times[grids[0]]) < 1000:
            for g, step in steps.items():
                t0 = time.perf_counter()
                step()
                times[g].append(time.perf_counter() - t0)
    out = {}
    per = _steps_per_call(method)
    for g, t in times.items():
        t.sort()
        out[g] = {"ms_min": 1e3 * t[0] / per, "ms_median": 1e3 * t[len(t) // 2] / per,
                  "reps": len(t)}
    return out


def table(result: dict) -> str:
    """The Markdown table of a results dict: ms per step and peak memory per grid."""
    grids = result["config"]["grids"]
    rows = {(r["method"], r["grid"]): r for r in result["rows"]}
    head = ("| method | " + " | ".join(f"{g}^3" for g in grids)
            + f" | {grids[-1]}^3 / {grids[0]}^3 |")
    lines = ["**ms per chunk step** (min of repetitions; torch CPU, 1 thread, float32)", "",
             head, "|---|" + "---:|" * (len(grids) + 1)]
    for method in METHODS:
        ms = [rows.get((method, g), {}).get("ms_min") for g in grids]
        cells = [f"{v:.2f}" if v is not None else "error" for v in ms]
        ratio = f"{ms[-1] / ms[0]:.2f}x" if None not in (ms[0], ms[-1]) else ""
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {ratio} |")
    for name, (num, den) in (("dense / local", ("dense", "local (fused)")),
                             ("local generic / fused", ("local (generic)", "local (fused)")),
                             ("vjp generic / fused", ("local vjp (generic)",
                                                      "local vjp (fused)"))):
        speed = []
        for g in grids:
            a, b = rows.get((num, g), {}).get("ms_min"), rows.get((den, g), {}).get("ms_min")
            speed.append(f"{a / b:.1f}x" if a and b else "")
        lines.append(f"| {name} | " + " | ".join(speed) + " | |")
    lines += ["", f"(`dense / local`: dense over `local (fused)`; the `vjp` rows: forward + "
              f"backward of a {VJP_STEPS}-step scan per call, / {VJP_STEPS}; `generic`: "
              f"`tmcore.options(native=False)`)"]
    ops = result.get("ops_per_step")
    if ops:
        lines += ["", f"**torch ops per chunk step** (a `TorchDispatchMode` count, "
                  f"{grids[0]}^3; the setup once per call excluded)", "",
                  "| path | forward | backward |", "|---|---:|---:|"]
        for name in ("generic", "fused"):
            lines.append(f"| {name} | {ops[name]['fwd']:g} | {ops[name]['bwd']:g} |")
    lines += ["", "**peak memory growth during one step** (resident set high-water mark; "
              f"the `vjp` rows: during one call of {VJP_STEPS} steps)", "",
              "| method | " + " | ".join(f"{g}^3" for g in grids) + " |",
              "|---|" + "---:|" * len(grids)]
    for method in METHODS:
        cells = []
        for g in grids:
            peak = rows.get((method, g), {}).get("peak_rss_growth_bytes")
            cells.append("error" if peak is None else f"{peak / 2**20:.1f} MiB")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: The layer's options timed by ``--layer``: ``(name, update, window?, warp)``.
LAYER_OPTIONS = (("dense (default)", "dense", False), ("local", "local", False),
                 ("warp", "dense", True), ("local + warp", "local", True))


def _layer_step(update: str, warp: bool, grid: int, batch: int, channels: int, window: int,
                backward: bool, steps: int):
    """A scan of ``steps`` chunks of the layer with these options, as a closure."""
    import torch

    import tmcore
    from tmcore.scan import options as dynamics
    from tmcore.types import StepInputs, WarpInputs

    h, c, read, write, sigma, content, params = _inputs(torch, batch, channels, grid)
    xp = tmcore.runtime.validate.namespace_of(h=h)
    g = torch.Generator().manual_seed(1)
    chunks = (batch, steps)
    inputs = StepInputs(torch.rand(*chunks, 3, generator=g) * 1.8 - 0.9,
                        torch.rand(*chunks, 3, generator=g) * 1.8 - 0.9,
                        sigma[:, None].expand(chunks).contiguous(),
                        torch.randn(*chunks, channels, generator=g))
    if warp:
        inputs = WarpInputs(*inputs, torch.full((*chunks, 3), 0.1))
    options = dynamics.ScanOptions(update, window if update == "local" else None)
    g_reads = torch.ones(batch, steps, channels)
    g_h, g_c = torch.ones_like(h), torch.ones_like(c)
    if update == "dense" and not warp:
        def step():
            if not backward:
                return tmcore.memory_scan(h, c, *inputs, params)
            return tmcore.memory_scan_vjp(h, c, *inputs, params, g_reads, g_h, g_c)
        return step

    def step():
        reads, h_t, c_t, residuals = dynamics.scan_fwd(xp, h, c, inputs, params, options,
                                                       keep=backward)
        if backward:
            return dynamics.scan_bwd(xp, residuals, inputs, params, options, g_reads, g_h,
                                     g_c)
        return reads, h_t, c_t
    return step


def measure_layer_options(grids: list[int], batch: int, channels: int, window: int,
                          min_seconds: float, steps: int = 8) -> list[dict]:
    """ms per chunk step of every :data:`LAYER_OPTIONS` entry at every grid, forward and
    forward + backward: a scan of ``steps`` chunks (one call per grid and option in
    turn) divided by ``steps``, so the once-per-call copies of the state count as they
    do in the layer; min and median."""
    import torch

    torch.set_num_threads(1)
    rows = []
    for backward in (False, True):
        calls = {(name, g): _layer_step(update, warp, g, batch, channels, window, backward,
                                        steps)
                 for name, update, warp in LAYER_OPTIONS for g in grids}
        times: dict = {key: [] for key in calls}
        with torch.no_grad():
            for step in calls.values():
                step()
            start = time.perf_counter()
            while (min(len(t) for t in times.values()) < 3
                   or time.perf_counter() - start < min_seconds * len(calls)) \
                    and len(next(iter(times.values()))) < 200:
                for key, step in calls.items():
                    t0 = time.perf_counter()
                    step()
                    times[key].append(time.perf_counter() - t0)
        for (name, g), t in times.items():
            t.sort()
            rows.append({"option": name, "grid": g, "pass": "fwd+bwd" if backward else "fwd",
                         "ms_min": 1e3 * t[0] / steps,
                         "ms_median": 1e3 * t[len(t) // 2] / steps, "reps": len(t)})
    return rows


def layer_table(result: dict) -> str:
    """The Markdown table of ``--layer``'s results."""
    grids = result["config"]["grids"]
    rows = {(r["option"], r["pass"], r["grid"]): r["ms_min"] for r in result["rows"]}
    lines = [f"**ms per chunk step of the layer's scan** (a scan of "
             f"{result['config']['steps']} chunks / {result['config']['steps']}; min of "
             f"repetitions; torch CPU, 1 thread, float32)", "",
             "| option | pass | " + " | ".join(f"{g}^3" for g in grids)
             + f" | {grids[-1]}^3 / {grids[0]}^3 |", "|---|---|" + "---:|" * (len(grids) + 1)]
    for pass_ in ("fwd", "fwd+bwd"):
        for name, _, _ in LAYER_OPTIONS:
            ms = [rows[(name, pass_, g)] for g in grids]
            lines.append(f"| {name} | {pass_} | " + " | ".join(f"{v:.2f}" for v in ms)
                         + f" | {ms[-1] / ms[0]:.1f}x |")
    return "\n".join(lines)


def _layer_main(args: argparse.Namespace, argv: list[str]) -> dict:
    from benchmarks.common import machine_line

    rows = measure_layer_options(args.grids, args.batch, args.channels, args.window,
                                 args.min_seconds, args.steps)
    config = {"grids": args.grids, "batch": args.batch, "channels": args.channels,
              "window": args.window, "spatial_rank": 3, "dtype": "float32", "threads": 1,
              "framework": "torch (CPU)", "min_seconds": args.min_seconds,
              "shift": 0.1, "sigma": "one cell", "steps": args.steps}
    result = {"command": " ".join(["python -m benchmarks.local_update", *argv]),
              "commit": _commit(), "machine": machine_line(), "config": config, "rows": rows}
    text = layer_table(result)
    if not args.tiny:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "layer_options.json"), "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        with open(os.path.join(args.out, "layer_options.md"), "w") as f:
            f.write(f"`{result['command']}` at {result['commit'][:10]}; "
                    f"{result['machine']}\n\n{text}\n")
    print(text)
    return result


def _run_plain(args: list[str]) -> dict:
    """``python -m benchmarks.local_update *args`` in a fresh process with this process's
    environment (``run_isolated`` pins glibc's mmap and trim thresholds, which the memory
    measurement needs but which make every small allocation a system call: timing runs
    without them). The last stdout line is parsed as JSON."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.local_update", *args],
                          capture_output=True, text=True, timeout=900,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=RESULTS).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grids", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--channels", type=int, default=16)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--min-seconds", type=float, default=2.0,
                   help="time spent repeating each method at each grid (at least 3 reps)")
    p.add_argument("--tiny", action="store_true", help="seconds: small sizes, no files")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--steps", type=int, default=8, help="--layer: chunks per scan call")
    p.add_argument("--layer", action="store_true",
                   help="time the layer's options (local, warp) instead; see the docstring")
    p.add_argument("--one", metavar="GRID", help=argparse.SUPPRESS)
    p.add_argument("--interleaved", metavar="METHOD", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.tiny:
        args.grids, args.batch, args.channels, args.min_seconds = [6, 10], 1, 2, 0.05
    names = {m.replace(" ", "_"): m for m in METHODS}
    if args.layer:
        os.environ["OMP_NUM_THREADS"] = "1"
        return _layer_main(args, argv)
    if args.one:
        got = {method: measure(method, int(args.one), args.batch, args.channels, args.window,
                               args.min_seconds, timing=False)
               for method in METHODS}
        print(json.dumps(got))
        return got
    if args.interleaved:
        got = measure_interleaved(names[args.interleaved], args.grids, args.batch,
                                  args.channels, args.window, args.min_seconds)
        print(json.dumps({str(g): v for g, v in got.items()}))
        return got
    from benchmarks.common import machine_line, run_isolated

    os.environ["OMP_NUM_THREADS"] = "1"  # the measuring processes inherit it
    base = [a for a in argv if a != "--tiny"] if not args.tiny else argv
    rows = []
    for grid in args.grids:
        got = run_isolated("benchmarks.local_update", [*base, "--one", str(grid)])
        for method in METHODS:
            rows.append({"method": method, "grid": grid,
                         **got.get(method, {"error": got.get("error")})})
            print(json.dumps(rows[-1]), file=sys.stderr)
    for method in METHODS:
        got = _run_plain([*base, "--interleaved", method.replace(" ", "_")])
        for row in rows:
            if row["method"] == method:
                row.update(got.get(str(row["grid"]), {"error": got.get("error")}))
        print(json.dumps(got), file=sys.stderr)
    config = {"grids": args.grids, "batch": args.batch, "channels": args.channels,
              "window": args.window, "box": args.window + 2, "spatial_rank": 3,
              "dtype": "float32", "threads": 1, "framework": "torch (CPU)",
              "min_seconds": args.min_seconds,
              "sigma": "one cell", "radius": None, "vjp_steps": VJP_STEPS,
              "generic": "tmcore.options(native=False)"}
    ops = count_ops(args.grids[0], args.batch, args.channels, args.window)
    print(json.dumps({"ops_per_step": ops}), file=sys.stderr)
    result = {"command": " ".join(["python -m benchmarks.local_update", *argv]),
              "commit": _commit(), "machine": machine_line(), "config": config, "rows": rows,
              "ops_per_step": ops}
    text = table(result)
    if not args.tiny:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "local_update.json"), "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        with open(os.path.join(args.out, "local_update.md"), "w") as f:
            f.write(f"`{result['command']}` at {result['commit'][:10]}; "
                    f"{result['machine']}\n\n{text}\n")
    print(text)
    return result


if __name__ == "__main__":
    main()

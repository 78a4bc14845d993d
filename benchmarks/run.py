"""Run the benchmark suite and write ``BENCHMARKS.md`` and ``benchmarks/results/*.png``.

``make bench`` runs ``python -m benchmarks.run``. Options:

- ``--quick``: one repetition at N=4096, no ``torch.compile`` there
  and a shorter streaming run (what ``make bench`` uses on a 2-core machine).
- ``--tiny``: one tiny configuration, every measurement, into ``--out``
  (a smoke test; the tests run it).
- ``--out DIR``: where ``BENCHMARKS.md``/``results/`` go (default: the repository).
- ``--render``: rewrite ``BENCHMARKS.md`` from ``results/results.json`` (and
  ``results/peak_memory.json``) without measuring.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import tmcore
from benchmarks.common import CONFIGS, TINY, Config, machine_line, run_isolated, time_fn
from benchmarks.layers import (
    floor_step,
    make_inputs,
    numpy_step,
    reference_params,
    torch_layer,
    torch_layer_source,
    torch_step,
)

__all__ = ["main", "check_gradients", "time_config"]

REPO = Path(__file__).resolve().parent.parent
IMPLS = {
    "torch": "torch layer, eager",
    "torch-ops": "torch layer, eager, torch ops only (fused C kernels off, `TMCORE_NATIVE=0`)",
    "torch-generic": "torch layer, eager, generic path (`tmcore.options(generic=True)`)",
    "torch-compile": "torch layer, `torch.compile`",
    "plain": "plain autograd baseline (eager)",
    "jax": "JAX layer, `jit`",
    "numpy": "NumPy, tmcore scan only",
}


def check_gradients(cfg: Config, rtol: float = 2e-3) -> dict:
    """Same parameters and inputs through tmcore's torch layer and the plain
    baseline in float64; the largest relative difference over outputs and all
    gradients. Raises ``AssertionError`` above ``rtol``."""
    params = reference_params(cfg)
    x, g = make_inputs(cfg)
    grads = {}
    for kind in ("plain", "torch"):
        layer = torch_layer(cfg, params, kind).double()
        xt = torch.as_tensor(x).double().requires_grad_(True)
        out = layer(xt)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.as_tensor(g).double())
        found = {"out": out.detach(), "x": xt.grad}
        if hasattr(layer, "tm_grads"):  # the baseline (and the stand-in) use Conv3d layouts
            found.update(layer.tm_grads())
        else:
            found.update({n: p.grad for n, p in layer.named_parameters()})
        grads[kind] = found
    worst = {}
    for name, ref in grads["plain"].items():
        got = grads["torch"][name]
        scale = float(ref.abs().max()) or 1.0
        worst[name] = float((got - ref).abs().max()) / scale
    bad = {k: v for k, v in worst.items() if not v <= rtol}
    assert not bad, f"tmcore vs plain autograd differ (max |diff| / max |ref|): {bad}"
    return {"max_rel_diff": max(worst.values()), "compared": sorted(worst)}


def _torch_fn(cfg, params, x, g, impl, train):
    if impl == "torch-ops":
        inner = torch_step(torch_layer(cfg, params, "torch"), x, g, train)

        def torch_ops():
            with tmcore.options(native=False):
                return inner()
        return torch_ops
    if impl == "torch-generic":
        inner = torch_step(torch_layer(cfg, params, "torch"), x, g, train)

        def generic():
            with tmcore.options(generic=True):
                return inner()
        return generic
    kind = "plain" if impl == "plain" else "torch"
    return torch_step(torch_layer(cfg, params, kind), x, g, train,
                      compiled=impl == "torch-compile")


_FAILED: dict[str, str] = {}


def time_config(cfg: Config, impls: list[str], reps: int, log) -> dict:
    """Per-step times (ms) of every implementation, forward and forward+backward,
    and the floor (pointwise matmuls of one step), all in this process."""
    params = reference_params(cfg)
    x, g = make_inputs(cfg)
    floor_reps = max(20, 2000 // cfg.steps)
    result = {"config": cfg.describe(), "steps": cfg.steps, "impls": {}}
    result["floor_ms"] = {
        mode: time_fn(floor_step(cfg, train), floor_reps)["min"] * 1e3
        for mode, train in (("fwd", False), ("train", True))
    }
    for impl in impls:
        row = {}
        isolated = _time_jax_isolated(cfg, reps) if impl == "jax" else None
        for mode, train in (("fwd", False), ("train", True)):
            if impl in _FAILED:  # e.g. torch.compile failing in the adapter: report it once
                row[mode] = {"error": f"skipped, failed earlier: {_FAILED[impl]}"[:200]}
                continue
            try:
                start = time.perf_counter()
                if impl == "jax":
                    if "error" in isolated:
                        raise RuntimeError(isolated["error"])
                    timing = isolated[mode]
                else:
                    fn = (numpy_step(cfg, params, train) if impl == "numpy"
                          else _torch_fn(cfg, params, x, g, impl, train))
                    timing = time_fn(fn, reps)
                per_step = timing["min"] / cfg.steps * 1e3
                row[mode] = {"ms_per_step": per_step,
                             "median_ms_per_step": timing["median"] / cfg.steps * 1e3,
                             "ratio": per_step / result["floor_ms"][mode],
                             "wall_s": time.perf_counter() - start}
            except Exception as exc:  # report, never hide, a failing implementation
                row[mode] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
                _FAILED[impl] = row[mode]["error"]
            log(f"  {cfg.name:8s} {impl:14s} {mode:5s} {_fmt_cell(row[mode])}")
        result["impls"][impl] = row
    return result


def _time_jax_isolated(cfg: Config, reps: int) -> dict:
    """The JAX layer's timings from a process of its own (:mod:`benchmarks.jax_timing`:
    its CPU kernels slowed later torch steps in a shared process)."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.jax_timing", "--config", cfg.name,
                           "--reps", str(reps)], capture_output=True, text=True, cwd=REPO,
                          timeout=1800)
    if proc.returncode != 0:
        return {"error": ((proc.stderr or proc.stdout).strip().splitlines() or ["failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fmt_cell(cell: dict) -> str:
    if "error" in cell:
        return "error: " + cell["error"][:60]
    return f"{cell['ms_per_step']:8.2f} ms/step ({cell['ratio']:5.1f}x floor)"


def memory_config(cfg: Config, impls: list[str], log) -> dict:
    out = {}
    for impl in impls:
        res = run_isolated("benchmarks.memory", ["--impl", impl, "--config", cfg.name])
        out[impl] = res.get("peak_bytes")
        if out[impl] is None:
            out[impl + "_error"] = res.get("error")
        log(f"  {cfg.name:8s} {impl:14s} peak {_mib(out[impl])}")
    return out


def _mib(b) -> str:
    return "n/a" if b is None else f"{b / 2**20:.1f} MiB"


def profile_summary(cfg: Config, params: dict, rows: int = 10) -> dict:
    """Where a training step's time goes: torch profiler (torch layer) and
    cProfile (NumPy scan), top entries by self time."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    x, g = make_inputs(cfg)
    step = torch_step(torch_layer(cfg, params, "torch"), x, g, train=True)
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    torch_rows = [(e.key, e.count, e.self_cpu_time_total / 1e3, e.self_cpu_time_total / total)
                  for e in events[:rows]]
    fn = numpy_step(cfg, params, train=True)
    fn()
    prof_np = cProfile.Profile()
    prof_np.enable()
    fn()
    prof_np.disable()
    stats = pstats.Stats(prof_np)
    entries = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])  # tottime
    np_total = sum(v[2] for _, v in entries) or 1.0
    numpy_rows = []
    for (file, line, func), (_, ncalls, tottime, _, _) in entries[:rows]:
        where = f"{Path(file).name}:{line}({func})" if line else func
        numpy_rows.append((where, ncalls, tottime * 1e3, tottime / np_total))
    return {"config": cfg.name, "torch": torch_rows, "numpy": numpy_rows}


# --------------------------------------------------------------------------- report


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _cell(row: dict | None, mode: str) -> str:
    if not row or mode not in row:
        return "—"
    c = row[mode]
    if "error" in c:
        return "error"
    return f"{c['ms_per_step']:.2f} ({c['ratio']:.1f}x)"


def timing_tables(timings: dict) -> str:
    parts = []
    for name, res in timings.items():
        header = ["implementation", "forward ms/step (x floor)", "fwd+bwd ms/step (x floor)"]
        rows = [["floor: pointwise matmuls", f"{res['floor_ms']['fwd']:.3f}",
                 f"{res['floor_ms']['train']:.3f}"]]
        for impl, row in res["impls"].items():
            rows.append([IMPLS.get(impl, impl), _cell(row, "fwd"), _cell(row, "train")])
        parts.append(f"**{name}**: {res['config']}\n\n" + _table(header, rows))
    return "\n\n".join(parts)


def memory_table(memory: dict) -> str:
    impls = sorted({k for v in memory.values() for k in v if not k.endswith("_error")},
                   key=list(IMPLS).index)
    header = ["config", *[IMPLS[i].split(",")[0] if i != "plain" else "plain autograd"
                          for i in impls], "torch / plain"]
    rows = []
    for name, res in memory.items():
        ratio = (f"{res['torch'] / res['plain']:.1%}" if res.get("torch") and res.get("plain")
                 else "—")
        rows.append([name, *[_mib(res.get(i)) for i in impls], ratio])
    return _table(header, rows)


def profile_tables(prof: dict) -> str:
    out = []
    for key, title in (("torch", "torch layer (torch.profiler, self CPU time)"),
                       ("numpy", "NumPy scan (cProfile, tottime)")):
        rows = [[f"`{name}`", str(count), f"{ms:.1f}", f"{share:.0%}"]
                for name, count, ms, share in prof[key]]
        out.append(f"{title}, one training step at {prof['config']}:\n\n"
                   + _table(["op", "calls", "ms", "share"], rows))
    return "\n\n".join(out)


def plot_timings(timings: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(timings)
    impls = [i for i in IMPLS if any(i in timings[n]["impls"] for n in names)]
    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=90)
    width = 0.8 / max(1, len(impls))
    for k, impl in enumerate(impls):
        vals = []
        for n in names:
            cell = timings[n]["impls"].get(impl, {}).get("train", {})
            vals.append(cell.get("ratio", np.nan))
        ax.bar(np.arange(len(names)) + k * width, vals, width, label=impl)
    ax.axhline(2.5, color="k", lw=0.8, ls="--", label="target 2.5x (LM)")
    ax.set_xticks(np.arange(len(names)) + width * (len(impls) - 1) / 2, names)
    ax.set_ylabel("fwd+bwd per step / floor")
    ax.set_yscale("log")
    ax.legend(fontsize=7, ncol=3)
    ax.set_title("Training step time relative to the pointwise-matmul floor")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_memory(memory: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lm = {n: r for n, r in memory.items() if n.startswith("lm-")}
    if not lm:
        return
    tokens = [int(n.split("-")[1]) for n in lm]
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=90)
    for impl in ("plain", "torch", "jax", "numpy"):
        vals = [lm[n].get(impl) for n in lm]
        if any(v is not None for v in vals):
            ax.plot(tokens, [np.nan if v is None else v / 2**20 for v in vals], "o-",
                    label=IMPLS[impl].split(",")[0])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens N (LM config)")
    ax.set_ylabel("peak memory of a training step (MiB)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _status(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**missed**")


def targets(timings: dict, memory: dict) -> list[str]:
    lines = []
    lm = [n for n in timings if n.startswith("lm-")]
    if lm:
        pick = "lm-1024" if "lm-1024" in lm else lm[0]
        r = timings[pick]["impls"]
        t = r.get("torch", {}).get("train", {})
        ratio = t.get("ratio")
        lines.append(f"- torch layer fwd+bwd per step at {pick}: "
                     f"{ratio:.2f}x the floor (target <= 3.0x; an earlier round's 2.5x: "
                     f"{_status(ratio <= 2.5)}): {_status(ratio <= 3.0)}"
                     if ratio else "- torch layer fwd+bwd: not measured")
        plain = r.get("plain", {}).get("train", {}).get("ms_per_step")
        if plain and t.get("ms_per_step"):
            q = plain / t["ms_per_step"]
            lines.append(f"- plain autograd / torch layer fwd+bwd at {pick}: {q:.2f}x faster "
                         f"(target >= 4x): {_status(q >= 4.0)}")
        j = r.get("jax", {}).get("train", {}).get("ms_per_step")
        if j and t.get("ms_per_step"):
            q = j / t["ms_per_step"]
            # the floor ratios say which side moved when this ratio changes between runs
            jr = r["jax"]["train"].get("ratio")
            floors = (f"; JAX {jr:.1f}x the floor, torch {ratio:.1f}x" if jr and ratio
                      else "")
            lines.append(f"- JAX jit fwd+bwd vs torch layer at {pick}: {q:.2f}x "
                         f"(target <= 1.5x{floors}): {_status(q <= 1.5)}")
    big = memory.get("lm-4096") or (memory.get(max(memory, key=lambda n: n)) if memory else None)
    if big and big.get("torch") and big.get("plain"):
        q = big["torch"] / big["plain"]
        lines.append(f"- peak training memory (what a warm step allocates), torch layer / plain "
                     f"autograd at the largest N: "
                     f"{q:.1%} (target <= 25 %): {_status(q <= 0.25)}")
    return lines


def git_state() -> dict:
    """``{"commit": HEAD or None, "dirty_paths": [...]}``: the code the run measured (the
    changed or untracked source files, docs and results left out)."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=30,
                                  check=True, cwd=REPO).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    paths = ("tmcore", "backends", "adapters", "benchmarks")
    names = (git("diff", "--name-only", "HEAD", "--", *paths)
             + git("ls-files", "--others", "--exclude-standard", "--", *paths)).split()
    return {"commit": git("rev-parse", "HEAD").strip() or None,
            "dirty_paths": sorted({n for n in names if n.endswith((".py", ".c", ".cc"))})}


def write_report(out: Path, results: dict) -> None:
    sections = [
        "# Benchmarks",
        "",
        "Generated by `make bench` — do not edit by hand; the text around the tables lives "
        "in `benchmarks/run.py` and `benchmarks/NOTES.md`.",
        "",
        f"- Command: `{results['command']}` ({results['wall_s'] / 60:.1f} min)",
        f"- Commit: {results.get('commit') or 'not recorded'}"
        + (f" + uncommitted changes to {', '.join(results['dirty_paths'])}"
           if results.get("dirty_paths") else ""),
        f"- Machine: {results['machine']}",
        f"- Load while measuring (1-min load average before / after): "
        f"{results['load_before']:.2f} / {results['load_after']:.2f}",
        f"- torch layer: {results['torch_source']}; torch threads: {results['threads']}",
        f"- Repetitions: {results['reps_note']}",
        "",
        "Times are per chunk step (one read, write and ConvLSTM update of the whole batch): "
        "the minimum over repetitions of the call divided by T. In brackets: the ratio to the "
        "**floor**, measured in the same run: the pointwise-mixing matrix products of one step "
        "alone, `P @ y` (forward) and also `g @ y^T`, `P^T @ g` (fwd+bwd), `P (4C, 2C)`, "
        "`y (B, 2C, prod S)`, torch float32 on the same threads.",
        "",
        "## Targets",
        "",
        *targets(results["timings"], results["memory"]),
        "",
        "## Time per chunk step",
        "",
        timing_tables(results["timings"]),
        "",
        "![ratio to floor](benchmarks/results/ratio_to_floor.png)",
        "",
        "## Peak memory of a training step",
        "",
        "Rise of the process's resident-set high-water mark during one forward+backward "
        "(second step, fresh process, glibc mmap threshold pinned so freed buffers are "
        "returned). Parameters and inputs are excluded; everything the step allocates "
        "(saved states, gradients, temporaries, the output) counts. What a step's first "
        "call costs a process on top (lazy imports, kernel loading, thread pools) does not: "
        "the first step runs before the measured one, so the targets' torch / plain ratio "
        "compares the tensors two implementations allocate per step, not a process's peak "
        "(the next section).",
        "",
        memory_table(results["memory"]),
        "",
        "Gradients: "
        + (f"tmcore's torch layer and the plain autograd baseline agree to "
           f"{results['gradcheck']['max_rel_diff']:.1e} (max |diff| / max |ref|, float64, over "
           f"the output, `x` and all {len(results['gradcheck']['compared']) - 2} parameter "
           f"tensors; asserted)." if "gradcheck" in results else "not checked."),
        "",
        "![peak memory](benchmarks/results/peak_memory.png)",
        "",
    ]
    if results.get("peak_rss"):
        from benchmarks import peak_memory

        now = results["peak_rss"]["now"]
        sections += [
            "## Peak resident memory of a layer call, from a fresh process", "",
            f"{now['describe']}; `{now['command']}` (`benchmarks.peak_memory`; each "
            "`make bench` rewrites `benchmarks/results/peak_memory.json` and shows the "
            "values it held beside its own): MiB by which one call raises the peak "
            "resident set (`VmHWM`, `ru_maxrss`) of a fresh process over what it held before "
            "the call, glibc's allocator at its defaults. `first`: the process's first call, "
            "lazy imports and kernel loading included, what a user's process pays; `warm`: "
            "after a two-chunk call of the same form, the call's own buffers only. "
            f"**grew**: more than {peak_memory.TOLERANCE:.0%} above the recorded value. "
            "Side by side with other commits: `--python A --python B` "
            "(`benchmarks/results/peak_memory_issue64.json`).", "",
            peak_memory.report(now["rows"], results["peak_rss"]["previous"]), ""]
    if results.get("truncated"):
        from benchmarks import truncated

        sections += ["## Truncated write: cost follows the footprint, not the grid", "",
                     truncated.report(results["truncated"]), "",
                     "![truncated write](benchmarks/results/truncated_write.png)", ""]
    if results.get("streaming"):
        from benchmarks import streaming

        body = (f"failed: {results['streaming']['error']}" if "error" in results["streaming"]
                else streaming.report(results["streaming"]))
        sections += ["## Streaming inference", "", body, "",
                     "![streaming](benchmarks/results/streaming.png)", ""]
    if results.get("profile"):
        sections += ["## Where the time goes", "", profile_tables(results["profile"]), ""]
    notes = Path(__file__).with_name("NOTES.md")
    if notes.exists():
        sections += [notes.read_text().strip(), ""]
    (out / "BENCHMARKS.md").write_text("\n".join(sections))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=str(REPO))
    parser.add_argument("--only", nargs="*", help="config names to run (default: all)")
    parser.add_argument("--impls", nargs="*", default=list(IMPLS), choices=list(IMPLS),
                        help="implementations to time (default: all)")
    parser.add_argument("--skip", nargs="*", default=[],
                        help="parts to skip: timing memory peak truncated streaming profile")
    parser.add_argument("--render", action="store_true",
                        help="rewrite BENCHMARKS.md from the recorded results, measuring nothing")
    args = parser.parse_args(argv)
    out = Path(args.out)
    (out / "benchmarks" / "results").mkdir(parents=True, exist_ok=True)
    if args.render:
        recorded = out / "benchmarks" / "results"
        results = json.loads((recorded / "results.json").read_text())
        if "peak_rss" not in results and (recorded / "peak_memory.json").exists():
            results["peak_rss"] = {"now": json.loads((recorded / "peak_memory.json").read_text()),
                                   "previous": None}
        write_report(out, results)
        return results
    start = time.perf_counter()
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    configs = [TINY] if args.tiny else [c for c in CONFIGS if not args.only or c.name in args.only]
    results = {
        "command": "make bench  (= " + " ".join(
            ["python -m benchmarks.run", *map(shlex.quote, argv if argv is not None
                                                else sys.argv[1:])]) + ")",
        **git_state(), "machine": machine_line(), "load_before": os.getloadavg()[0],
        "torch_source": torch_layer_source(), "threads": torch.get_num_threads(),
        "reps_note": ("minimum of N repetitions after one warm-up: "
                      + ", ".join(f"{c.name} {1 if args.quick and c.steps >= 256 else c.reps}"
                                  for c in configs)
                      + ("; --quick: torch.compile skipped at N=4096 (same per-step work as "
                         "N=1024)" if args.quick else "")),
        "timings": {}, "memory": {},
    }
    if "timing" not in args.skip:
        results["gradcheck"] = check_gradients(TINY)
        log(f"gradients vs plain autograd: max rel diff {results['gradcheck']['max_rel_diff']:.1e}")
    for cfg in configs:
        if "timing" not in args.skip:
            impls = list(args.impls)
            if args.quick and cfg.tokens >= 4096 and "torch-compile" in impls:
                impls.remove("torch-compile")
            reps = 1 if args.quick and cfg.steps >= 256 else cfg.reps
            results["timings"][cfg.name] = time_config(cfg, impls, reps, log)
        if "memory" not in args.skip:
            results["memory"][cfg.name] = memory_config(cfg, ["torch", "plain", "jax", "numpy"],
                                                        log)
    if "peak" not in args.skip:
        from benchmarks import peak_memory

        peak_cfg = TINY if args.tiny else next(c for c in CONFIGS if c.name == "lm-4096")
        results["peak_rss"] = peak_memory.bench(out, peak_cfg)
        log(f"  peak resident set: {results['peak_rss']['now']['rows'][0]['median_mib']}")
    if "truncated" not in args.skip:
        from benchmarks import truncated

        results["truncated"] = truncated.run(tiny=args.tiny, log=log)
        truncated.plot(results["truncated"], out / "benchmarks" / "results"
                       / "truncated_write.png")
    if "streaming" not in args.skip:
        from benchmarks import streaming

        flags = [f for f, on in (("--tiny", args.tiny), ("--quick", args.quick)) if on]
        results["streaming"] = run_isolated("benchmarks.streaming", flags)
        log(f"  streaming: {results['streaming'].get('memory', results['streaming'])}")
        streaming.plot(results["streaming"], out / "benchmarks" / "results" / "streaming.png")
    if "profile" not in args.skip:
        prof_cfg = TINY if args.tiny else next(c for c in CONFIGS if c.name == "lm-256")
        results["profile"] = profile_summary(prof_cfg, reference_params(prof_cfg))
    results["wall_s"] = time.perf_counter() - start
    results["load_after"] = os.getloadavg()[0]
    results_dir = out / "benchmarks" / "results"
    if results["timings"]:
        plot_timings(results["timings"], results_dir / "ratio_to_floor.png")
    if results["memory"]:
        plot_memory(results["memory"], results_dir / "peak_memory.png")
    (results_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
    write_report(out, results)
    log(f"wrote {out / 'BENCHMARKS.md'} in {results['wall_s'] / 60:.1f} min")
    return results


if __name__ == "__main__":
    main()

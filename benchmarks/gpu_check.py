"""One prepared GPU check: agreement and timings of every fast path vs the generic path.

    python benchmarks/gpu_check.py                  # CUDA: torch-cuda, jax-gpu, cupy
    python benchmarks/gpu_check.py --device cpu     # the same on the CPU (tested in CI)

For each library that imports and sees the device (otherwise it prints
``skipped: why``), each config (``lm`` B=8 C=32 8^3, ``wide`` B=2 C=64 8^3,
``toy`` B=32 C=16 6^3) and each case (read, write, factorized conv 2C -> 4C,
forward and VJP, and the scan step forward and VJP), it runs the fast path
and the forced-generic path in float32, checks both against the float64 NumPy
generic path (relative error <= ``--tol``), checks that the VJPs are bitwise
reproducible, and prints one table of best-of-n milliseconds. Runs in
well under 4 minutes on one GPU. Exit status 1 when any check fails.

    python benchmarks/gpu_check.py --triton-compile [--arch 90]

compiles the fused scan's Triton kernels (forward, backward A, backward B) for
an NVIDIA target with Triton's own LLVM and ptxas, no GPU needed, at the
benchmark shapes, and prints compile time, shared memory, and registers and spills
per thread from ``ptxas -v`` (run without ``TRITON_INTERPRET``).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time

import _backend_bench as bb


def _framework(name: str, device: str):
    """``(Framework, None)`` or ``(None, why it is skipped)``."""
    module_name = {"torch": "torch", "jax": "jax", "cupy": "cupy", "numpy": "numpy"}[name]
    if importlib.util.find_spec(module_name) is None:
        return None, "not installed"
    try:
        fw = bb.Framework(name, device)
        if device == "cuda":
            if name == "torch" and not fw.module.cuda.is_available():
                return None, "torch sees no CUDA device"
            if name == "jax":
                import jax

                try:
                    jax.devices("gpu")
                except RuntimeError as err:
                    return None, f"jax has no GPU backend ({str(err).splitlines()[0]})"
            if name == "cupy" and fw.module.cuda.runtime.getDeviceCount() < 1:
                return None, "cupy sees no CUDA device"
        elif name == "cupy":
            return None, "cupy runs only on a GPU"
        elif name == "jax":
            import jax

            jax.config.update("jax_platforms", "cpu")
        return fw, None
    except Exception as err:  # noqa: BLE001 - report any import/driver failure and go on
        return None, f"{type(err).__name__}: {err}"


def _deterministic(fw, config: str) -> bool:
    """The fast VJPs give bitwise-identical results on two runs."""
    import numpy as np

    batch, channels, grid = bb.CONFIGS[config]
    inputs = {k: fw.convert(v, "float32")
              for k, v in bb.make_inputs(batch, channels, grid).items()}
    for case, fn in bb.case_fns(fw).items():
        if not case.endswith("vjp"):
            continue
        run = fw.prepare(fn, inputs, generic=False)
        first = [bb.to_numpy(x) for x in bb.flatten(run())]
        second = [bb.to_numpy(x) for x in bb.flatten(run())]
        if not all(np.array_equal(a, b) for a, b in zip(first, second, strict=True)):
            print(f"  {fw.name}: {case} is not bitwise reproducible")
            return False
    return True


#: (name, grid padded to 3 axes, channels) of the kernels compiled by --triton-compile
COMPILE_SHAPES = [("lm", (8, 8, 8), 32), ("toy", (6, 6, 6), 16), ("vit", (8, 8, 8), 64),
                  ("2d", (1, 5, 7), 3), ("1d", (1, 1, 9), 4)]


def triton_compile(arch: int, shapes: list[str], dtype: str) -> int:
    """Compile the fused kernels for ``sm_<arch>`` (no device needed); 0 when all build."""
    import os

    if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter replaces the compiler")
        return 1
    import triton
    from triton.backends.compiler import GPUTarget

    # (the one place a benchmark reads backend internals: this compiles the backend's own
    # kernels, at the geometry its driver would launch them with; no public API is that)
    from tmcore.backends.triton import dense
    from tmcore.backends.triton import dense_kernels as k

    failures = 0
    for name, s3, channels in COMPILE_SHAPES:
        if name not in shapes:
            continue
        n = sum(1 for size in s3 if size > 1) if name in ("2d", "1d") else 3
        geo = dense._Geometry(_FakeState((2, channels, *s3[3 - n:])))
        for fn, extra in ((k.step_fwd_kernel, {"WRITE_READ": True, "PRECISION": "ieee",
                                                "HAS_ACTIVE": False}),
                          (k.step_bwd_a_kernel, {"PRECISION": "ieee"}),
                          (k.step_bwd_b_kernel, {})):
            consts = {**geo.constexprs(True), **extra}
            signature = {a: ("constexpr" if a in consts else "i32" if a in ("t", "T", "C")
                             else "fp32" if a in ("eps", "radius") else f"*{dtype}")
                         for a in fn.arg_names}
            start = time.perf_counter()
            try:
                compiled = triton.compile(
                    triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=consts),
                    target=GPUTarget("cuda", arch, 32),
                    options={"num_warps": geo.fwd_warps if fn is k.step_fwd_kernel
                             else geo.num_warps})
            except Exception as err:  # noqa: BLE001 - report every kernel
                failures += 1
                print(f"FAIL {name} {fn.__name__}: {type(err).__name__}: {str(err)[:300]}")
                continue
            seconds = time.perf_counter() - start
            print(f"{name:4s} C={channels:<3d} {fn.__name__:18s} {dtype} sm_{arch}: "
                  f"{seconds:6.1f} s, shared {compiled.metadata.shared} B, "
                  f"{_ptxas_usage(compiled.asm['ptx'], arch)}", flush=True)
    print(f"triton {triton.__version__}: {failures} failures")
    return 1 if failures else 0


def _ptxas_usage(ptx: str, arch: int) -> str:
    """Registers and spills per thread, from Triton's bundled ``ptxas -v`` on the PTX."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/k.ptx"
        with open(path, "w") as f:
            f.write(ptx)
        try:
            target = re.search(r"\.target\s+(sm_\w+)", ptx)
            sm = target.group(1) if target else f"sm_{arch}"
            done = subprocess.run([get_ptxas(arch).path, f"-arch={sm}", "-v", path, "-o",
                                   f"{tmp}/k.cubin"], capture_output=True, text=True,
                                  timeout=600)
        except Exception as err:  # noqa: BLE001 - informative only
            return f"ptxas: {type(err).__name__}"
    text = done.stdout + done.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return (f"{regs.group(1) if regs else '?'} registers, "
            f"spill stores/loads {spills.group(1)}/{spills.group(2)} B" if spills
            else text.strip()[-200:])


class _FakeState:
    """Shape-only stand-in for a state tensor (the geometry needs shape and device)."""

    def __init__(self, shape):
        self.shape = shape
        self.is_cuda = True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--frameworks", nargs="+", default=None,
                        help="default: torch jax cupy (cuda) or numpy torch jax (cpu)")
    parser.add_argument("--configs", nargs="+", default=["lm", "wide", "toy"],
                        choices=list(bb.CONFIGS))
    parser.add_argument("--budget", type=float, default=0.2, help="seconds per timing")
    parser.add_argument("--tol", type=float, default=5e-4, help="float32 relative tolerance")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--triton-compile", action="store_true",
                        help="only compile the fused Triton kernels for --arch (no GPU needed)")
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    parser.add_argument("--shapes", nargs="+", default=["lm"],
                        choices=[name for name, _, _ in COMPILE_SHAPES])
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "fp64"])
    args = parser.parse_args(argv)
    start = time.perf_counter()
    bb.ensure_tmcore()
    if args.triton_compile:
        return triton_compile(args.arch, args.shapes, args.dtype)
    names = args.frameworks or (["torch", "jax", "cupy"] if args.device == "cuda"
                                else ["numpy", "torch", "jax"])
    expected = {config: bb.expected_outputs(config) for config in args.configs}
    rows, failures = [], []
    for name in names:
        fw, why = _framework(name, args.device)
        if fw is None:
            print(f"{name}: skipped: {why}")
            continue
        if name == "torch" and args.threads:
            fw.module.set_num_threads(args.threads)
        for config in args.configs:
            try:
                new = bb.bench_table(fw, config, budget_s=args.budget, expected=expected[config])
            except Exception as err:  # noqa: BLE001 - report and continue with the others
                failures.append(f"{name} {config}: {type(err).__name__}: {err}")
                continue
            rows.extend(new)
            failures += [f"{row[0]} {config} {row[2]}: error {max(row[6:]):.1e} > {args.tol}"
                         for row in new if max(row[6:]) > args.tol]
        if not _deterministic(fw, args.configs[0]):
            failures.append(f"{name}: VJPs not bitwise reproducible")
    bb.print_rows(rows)
    print(f"checks: {len(rows)} cases, {len(failures)} failures; "
          f"{time.perf_counter() - start:.0f} s")
    for failure in failures:
        print(f"FAIL {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

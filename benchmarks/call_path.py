"""The library files one call runs code in: how long the path of a call is to read.

A file counts when code of it executes during the call (``sys.setprofile``: a Python
function, method or module body of the file is entered); the library is ``tmcore/``
(without ``tmcore/testing``), ``backends/`` and ``adapters/``. Two calls:

- torch: a WARM forward of ``MemoryResidual(TensorMemory(16, 4, (4, 4, 4), 4))`` on
  ``x (2, 16, 16)`` (one call first, so imports and caches are made);
- jax: the trace of ``jax.jit`` over ``tmj.apply`` for the same layer (the Python a
  compiled call runs once per shape), after a trace at another batch size.

    python -m benchmarks.call_path            # the files, per call
    python -m benchmarks.call_path --json     # the same as JSON (with commit and machine)
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["library_roots", "files_run", "torch_forward", "jax_trace", "main"]

EMBED, CHANNELS, SHAPE, CHUNK = 16, 4, (4, 4, 4), 4
BATCH, TOKENS = 2, 16
LAYER = f"TensorMemory({EMBED}, {CHANNELS}, {SHAPE}, {CHUNK})"


def library_roots() -> dict[str, Path]:
    """The library's folders, as named in the repository, and where they are imported from."""
    import tmcore
    import tmcore.adapters
    import tmcore.backends

    return {"tmcore": Path(tmcore.__file__).resolve().parent,
            "backends": Path(tmcore.backends.__path__[0]).resolve(),
            "adapters": Path(tmcore.adapters.__path__[0]).resolve()}


def _library_name(filename: str, roots: dict[str, Path]) -> str | None:
    """``filename`` as a repository path (``tmcore/layer/layer.py``), or None outside
    the library."""
    path = Path(filename).resolve()
    for folder, root in roots.items():
        if path.is_relative_to(root):
            name = f"{folder}/{path.relative_to(root).as_posix()}"
            return None if name.startswith("tmcore/testing/") else name
    return None


def files_run(call: Callable[[], Any]) -> dict[str, int]:
    """Run ``call()``; ``{library file: distinct functions of it that ran}``, sorted."""
    roots = library_roots()
    codes: set[Any] = set()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            codes.add(frame.f_code)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(previous)
    counts: collections.Counter[str] = collections.Counter()
    for code in codes:
        name = _library_name(code.co_filename, roots)
        if name is not None:
            counts[name] += 1
    return dict(sorted(counts.items()))


def torch_forward() -> dict[str, int]:
    """The files a warm ``MemoryResidual(TensorMemory(...))(x)`` runs code in."""
    import torch

    from tmcore.adapters.torch import MemoryResidual, TensorMemory

    torch.manual_seed(0)
    layer = MemoryResidual(TensorMemory(EMBED, CHANNELS, SHAPE, CHUNK))
    x = torch.randn(BATCH, TOKENS, EMBED)
    layer(x)
    return files_run(lambda: layer(x))


def jax_trace() -> dict[str, int]:
    """The files tracing ``jax.jit`` over ``tmj.apply`` runs code in."""
    import jax

    from tmcore.adapters import jax as tmj

    params = tmj.init(jax.random.key(0), EMBED, CHANNELS, SHAPE, CHUNK)

    def apply(p: Any, x: Any) -> Any:
        return tmj.apply(p, x)[0]

    jax.jit(apply).trace(params, jax.numpy.zeros((BATCH + 1, TOKENS, EMBED)))
    x = jax.random.normal(jax.random.key(1), (BATCH, TOKENS, EMBED))
    return files_run(lambda: jax.jit(apply).trace(params, x))


CALLS = {"torch": (torch_forward, f"a warm MemoryResidual({LAYER})(x), x ({BATCH}, {TOKENS}, "
                                  f"{EMBED})"),
         "jax": (jax_trace, f"jax.jit(tmj.apply).trace(params, x) for {LAYER}, x ({BATCH}, "
                            f"{TOKENS}, {EMBED})")}


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", nargs="+", choices=tuple(CALLS), default=tuple(CALLS))
    parser.add_argument("--json", action="store_true", help="print JSON instead of lines")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"command": "python -m benchmarks.call_path "
                                         + " ".join(sys.argv[1:] if argv is None else argv)}
    for framework in args.framework:
        measure, call = CALLS[framework]
        functions = measure()
        result[framework] = {"call": call, "files": len(functions), "functions": functions}
    if args.json:
        from benchmarks.common import machine_line
        from benchmarks.run import git_state

        result.update(git_state(), machine=machine_line())
        print(json.dumps(result, indent=1))
        return result
    for framework in args.framework:
        found = result[framework]
        print(f"{framework}: {found['call']}: {found['files']} library files "
              f"(functions run in each)")
        for name, count in found["functions"].items():
            print(f"  {count:4d}  {name}")
    return result


if __name__ == "__main__":
    main()

"""``python -m examples.hf run [--tiny] [--seeds 0 1 2] [--out FILE]`` and
``python -m examples.hf render [--results FILE] [--readme FILE]`` (see finetune.py)."""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "finetune.json"
README = HERE / "README.md"
_BLOCK = re.compile(r"(<!-- results: finetune -->\n)(.*?)(<!-- /results -->)", re.S)


def render(results_path: Path, readme: Path) -> str:
    """Write the results' table into ``readme`` (between its results markers)."""
    from examples.hf.finetune import table

    results = json.loads(results_path.read_text())
    text = table(results)
    body = readme.read_text()
    if not _BLOCK.search(body):
        raise SystemExit(f"{readme}: no '<!-- results: finetune -->' block")
    readme.write_text(_BLOCK.sub(lambda m: m.group(1) + text + "\n" + m.group(3), body))
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.hf")
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="pretrain, add memory, fine-tune, evaluate")
    run_p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run")
    run_p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    run_p.add_argument("--out", type=Path, default=None,
                       help=f"results file (default {RESULTS.relative_to(HERE.parents[1])}; "
                            f"--tiny writes none unless given)")
    render_p = sub.add_parser("render", help="render the results into the README table")
    render_p.add_argument("--results", type=Path, default=RESULTS)
    render_p.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(argv)
    if args.command == "render":
        print(render(args.results, args.readme))
        return
    from examples.hf.finetune import Config, run, table

    config = Config.tiny() if args.tiny else Config()
    with tempfile.TemporaryDirectory() as work:
        results = run(config, args.seeds, Path(work))
    out = args.out if args.out is not None else (None if args.tiny else RESULTS)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {out}")
    print(table(results))
    print("generate demo (memory model, greedy):", repr(results["seeds"][0]["demo"]))


if __name__ == "__main__":
    main()

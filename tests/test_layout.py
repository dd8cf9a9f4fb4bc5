"""The package's layout rules (docs/architecture.md), read from the source with `ast`.

- `hf_primal.modeling` is the remote code of every shared folder: its modules import only the standard library,
  torch, transformers and each other, flat (``from .x import``), and never hf_primal by absolute name.
- The method modules are plain torch: no transformers import.
- The architecture modules (`hf_primal.models.<arch>`) import hf_primal only from `..modeling`, so that their
  flattened copy (``modeling_primal_<arch>.py``) finds everything beside it.
- No module of the package is over 400 lines, no function over 60.
- No arrow runs back up: no module below the package imports its ``__init__`` (``from .. import``, ``import
  hf_primal``); each takes what it needs from the room that defines it.
"""

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_primal"
MODELING = sorted((PACKAGE / "modeling").glob("*.py"))
METHOD = ("primal", "sampling", "kernel", "fused_heads", "decode")
ARCHITECTURES = sorted(p for p in (PACKAGE / "models").glob("*.py") if p.name != "__init__.py")
THIRD_PARTY_OK = {"torch", "transformers"}


def _imports(path: Path):
    """(level, module, names) of every import statement of `path`, at any depth (lazy imports included)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            yield node.level, node.module or "", [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield 0, alias.name, []


def _top(module: str) -> str:
    return module.split(".")[0]


@pytest.mark.parametrize("path", MODELING, ids=lambda p: p.name)
def test_modeling_modules_import_only_torch_transformers_and_their_siblings(path):
    siblings = {p.stem for p in MODELING}
    for level, module, _ in _imports(path):
        if level == 0:
            top = _top(module)
            assert top in THIRD_PARTY_OK or top in sys.stdlib_module_names or top == "__future__", (path.name, module)
        else:
            assert level == 1, (path.name, level, module)  # flat: what transformers' remote-code loader follows
            assert module in siblings, (path.name, module)


@pytest.mark.parametrize("name", METHOD)
def test_method_modules_are_plain_torch(name):
    tops = {_top(module) for level, module, _ in _imports(PACKAGE / "modeling" / f"{name}.py") if level == 0}
    assert "transformers" not in tops, name


@pytest.mark.parametrize("path", ARCHITECTURES, ids=lambda p: p.name)
def test_architecture_modules_import_hf_primal_only_from_modeling(path):
    for level, module, _ in _imports(path):
        if level == 0:
            assert _top(module) != "hf_primal", (path.name, module)
        else:
            assert level == 2 and module.startswith("modeling."), (path.name, level, module)


def test_no_module_is_over_400_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 400}
    assert not long, long


def test_no_function_is_over_60_lines():
    long = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long[f"{path.relative_to(PACKAGE)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert not long, long


def test_one_place_reads_the_primal_marker():
    # Which modules run Primal-Attention is answered by modeling.architecture.is_primal_attention (and
    # primal_attention_modules); everything else asks it, so the marker can change in one place.
    readers = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr")
                    and len(node.args) > 1 and getattr(node.args[1], "value", None) == "_is_primal_attention"):
                readers.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert [r.split(":")[0] for r in readers] == ["modeling/architecture.py"], readers


@pytest.mark.parametrize("pattern, home", [
    ('("sequence", "batch")', "modeling/config.py"),  # the KSVD reduction names
    ("CROP_WINDOW = ", "modeling/config.py"),  # the crop window's default
    ("base_model_prefix", "modeling/architecture.py"),  # where a model's base model is
    ("must be a finite real number >= 0", "modeling/config.py"),  # the check of a loss weight (eta, eta_kl)
    # what a load report leaves out (compat.py lists the transformers internal it writes to)
    ("_keys_to_ignore_on_load_unexpected", "integration/compat.py modeling/architecture.py"),
])
def test_each_rule_has_one_home(pattern, home):
    found = [str(path.relative_to(PACKAGE)) for path in sorted(PACKAGE.rglob("*.py"))
             if pattern in path.read_text(encoding="utf-8")]
    assert found == home.split(), found


def _upward(path: Path) -> list[str]:
    """The imports of `path` that resolve to the package's own ``__init__``."""
    up = len(path.relative_to(PACKAGE).parts)  # the level of "from .. import" that names hf_primal from here
    found = []
    for level, module, names in _imports(path):
        if level == 0 and (module == "hf_primal" or (module == "" and "hf_primal" in names)):
            found.append(f"import {module}")
        elif level == up and not module:
            found.append(f"from {'.' * level} import {', '.join(names)}")
        elif level == 0 and module == "hf_primal" and names:
            found.append(f"from hf_primal import {', '.join(names)}")
    return found


@pytest.mark.parametrize("path", sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py"),
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_the_package_init(path):
    assert _upward(path) == [], (str(path.relative_to(PACKAGE)), _upward(path))


def test_the_upward_import_check_sees_both_spellings(tmp_path):
    # A module one room down that reaches back up either way is caught (the check above cannot pass vacuously).
    for text in ("from .. import convert\n", "import hf_primal\n", "def f():\n    from hf_primal import ksvd_loss\n"):
        probe = PACKAGE / "tools" / "_probe_upward.py"
        probe.write_text(text)
        try:
            assert _upward(probe), text
        finally:
            probe.unlink()
    sibling = PACKAGE / "tools" / "_probe_sibling.py"
    sibling.write_text("from ..modeling.config import PrimalAttentionConfig\nfrom . import demo\n")
    try:
        assert _upward(sibling) == []
    finally:
        sibling.unlink()


# ---------------------------------------------------------------------------------------------- scripts/
SCRIPTS = PACKAGE.parent / "scripts"
SCRIPT_FILES = sorted(SCRIPTS.rglob("*.py"))
# A benchmark is a module with a main(), or a folder run as a package (its __main__.py).
BENCHMARKS = sorted([p for p in (SCRIPTS / "benchmarks").glob("*.py") if "def main(" in p.read_text(encoding="utf-8")]
                    + [p.parent for p in (SCRIPTS / "benchmarks").glob("*/__main__.py")])


def test_scripts_hold_benchmarks_and_examples_only():
    assert {p.relative_to(SCRIPTS).parts[0] for p in SCRIPT_FILES if p.name != "__init__.py"} == {"benchmarks",
                                                                                                  "examples"}
    assert {p.stem for p in BENCHMARKS} >= {"layers", "peers", "generation", "long_documents", "conversion",
                                            "conversion_tasks", "uncertainty"}


@pytest.mark.parametrize("path", SCRIPT_FILES, ids=lambda p: str(p.relative_to(SCRIPTS)))
def test_no_script_edits_sys_path_or_imports_a_private_name(path):
    text = path.read_text(encoding="utf-8")
    assert "sys.path" not in text, path.name
    local = {p.stem for p in path.parent.glob("*.py")}
    for level, module, names in _imports(path):
        own = level > 0 or module.split(".")[0] in local
        assert not (own and any(n.startswith("_") and n != "__future__" for n in names)), (path.name, module, names)
        assert not (own and module.split(".")[-1].startswith("_")), (path.name, module)


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.stem)
def test_benchmarks_are_short_and_import_no_other_benchmark(path):
    others = {p.stem for p in BENCHMARKS} - {path.stem}
    # A folder's modules import each other (level 1) and what beside them is shared (level 2).
    files, level_out = ([path], 1) if path.is_file() else (sorted(path.glob("*.py")), 2)
    for file in files:
        assert len(file.read_text(encoding="utf-8").splitlines()) <= 350, file.name
        for level, module, names in _imports(file):
            if level == level_out:
                imported = {module.split(".")[0]} if module else set(names)
                assert not imported & others, (file.name, imported & others)


def test_the_architecture_doc_names_every_module():
    # A module added without a line in docs/architecture.md's layout is a room nobody was told about.
    import re

    text = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    registry = re.search(r"one module per architecture \(([^)]*)\)", text).group(1)

    def named(path: Path) -> bool:
        if path.parent.name == "models":
            return path.stem in [name.strip() for name in registry.split(",")]
        return re.search(rf"(?<![\w/.]){re.escape(path.name)}", text) is not None

    missing = [str(p.relative_to(PACKAGE)) for p in sorted(PACKAGE.rglob("*.py"))
               if p.name != "__init__.py" and p.parent.name != "metrics" and not named(p)]
    assert missing == []

"""The transformers internals hf_primal hooks are listed in one place and checked at import."""

import inspect
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import transformers
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import hf_primal  # noqa: F401  (installs the hooks)
from hf_primal.integration import compat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _owner_and_name(path: str):
    owner_path, _, name = path.rpartition(".")
    return compat._resolve(owner_path), name


def test_setup_py_declares_the_checked_range():
    with open(os.path.join(ROOT, "setup.py")) as f:
        requirements = re.findall(r'"transformers([^"]*)"', f.read())
    assert requirements == [compat.TRANSFORMERS_RANGE]
    # CI runs the suite on the lowest and newest release of that range: the installed one must be inside it.
    assert Version(Version(transformers.__version__).base_version) in SpecifierSet(compat.TRANSFORMERS_RANGE)


def test_every_listed_internal_resolves_on_the_installed_transformers():
    compat.check_transformers()
    owners = [compat._resolve(entry.path.rpartition(".")[0]) for entry in compat.INTERNALS]
    assert all(hasattr(owner, entry.path.rpartition(".")[2]) for owner, entry in zip(owners, compat.INTERNALS))


@pytest.mark.parametrize("entry", [e for e in compat.INTERNALS if not e.added],
                         ids=lambda e: e.path.replace("transformers.", ""))
def test_a_missing_internal_is_named_with_version_and_range(entry, monkeypatch):
    owner, name = _owner_and_name(entry.path)
    # Remove it wherever the lookup could find it (the owner and, for classes, every base defining it).
    holders = [cls for cls in owner.__mro__ if name in vars(cls)] if inspect.isclass(owner) else [owner]
    assert holders, entry.path
    if any(isinstance(holder, type) and holder.__flags__ & (1 << 8) for holder in holders):  # Py_TPFLAGS_IMMUTABLETYPE
        # A builtin (immutable) type such as torch's tensor base: make the lookup fail instead.
        resolve = compat._resolve
        monkeypatch.setattr(compat, "_resolve", lambda path: (_ for _ in ()).throw(AttributeError(path))
                            if path == entry.path else resolve(path))
    else:
        for holder in holders:
            monkeypatch.delattr(holder, name)
    with pytest.raises(compat.IncompatibleTransformersError) as err:
        compat.check_transformers()
    message = str(err.value)
    assert entry.path in message and transformers.__version__ in message and compat.TRANSFORMERS_RANGE in message


@pytest.mark.parametrize("entry", [e for e in compat.INTERNALS if e.params], ids=lambda e: e.path.split(".")[-1])
def test_a_dropped_parameter_is_named(entry, monkeypatch):
    owner, name = _owner_and_name(entry.path)
    kept = [p for p in entry.params[:-1]]
    dropped = entry.params[-1]
    namespace: dict = {}
    exec(f"def {name}(self, {', '.join(kept + ['other'])}): pass", namespace)
    replacement = namespace[name]
    if entry.keys:  # a mapping: each listed entry's value must accept the parameters
        monkeypatch.setitem(getattr(owner, name), entry.keys[-1], replacement)
    else:
        if isinstance(inspect.getattr_static(owner, name), classmethod):
            replacement = classmethod(replacement)
        monkeypatch.setattr(owner, name, replacement)
    with pytest.raises(compat.IncompatibleTransformersError, match=re.escape(f"['{dropped}']")):
        compat.check_transformers()


@pytest.mark.parametrize("entry", [e for e in compat.INTERNALS if e.keys], ids=lambda e: e.path.split(".")[-1])
def test_a_missing_mapping_entry_is_named(entry, monkeypatch):
    mapping = compat._resolve(entry.path)
    monkeypatch.delitem(mapping, entry.keys[0])
    with pytest.raises(compat.IncompatibleTransformersError, match=re.escape(f"['{entry.keys[0]}']")):
        compat.check_transformers()


def test_every_patched_internal_is_replaced_by_hf_primal():
    for path in compat.patched_internals():
        current = compat._resolve(path)
        keys = next(e.keys for e in compat.INTERNALS if e.path == path)
        for func in [current[key] for key in keys] if keys else [getattr(current, "__func__", current)]:
            assert func.__module__.startswith("hf_primal."), path
    with pytest.raises(KeyError, match="not listed as a patched entry"):
        compat.patch_entry("transformers.masking_utils.AttentionMaskInterface._global_mapping", "flex_attention", None)


def _hf_primal_attributes() -> set[str]:
    """Every attribute of a loaded transformers module or of a class defined in one that holds an hf_primal
    function or class, or whose name says primal: what hf_primal changed in transformers."""
    found = set()
    for module_name, module in list(sys.modules.items()):
        if not (module_name == "transformers" or module_name.startswith("transformers.")) or module is None:
            continue
        owners = [(module_name, module)] + list({  # a class under two names (an alias) once, by its own name
            f"{module_name}.{value.__qualname__}": value for value in list(vars(module).values())
            if isinstance(value, type) and value.__module__ == module_name}.items())
        for owner_name, owner in owners:
            for name, value in list(vars(owner).items()):
                func = getattr(value, "__func__", value)
                defined_in = getattr(func, "__module__", None) or ""
                if defined_in.startswith("hf_primal") or "primal" in name.lower():
                    found.add(f"{owner_name}.{name}")
                if type(value) is dict:  # registries such as the mask functions per attention implementation
                    found.update(f"{owner_name}.{name}[{key}]" for key, item in list(value.items())
                                 if isinstance(key, str) and (getattr(item, "__module__", None) or "").startswith(
                                     "hf_primal"))
    return found


def test_nothing_is_patched_that_is_not_listed():
    changed = _hf_primal_attributes()
    assert "transformers.configuration_utils.PreTrainedConfig.primal_attention" in changed  # the walk sees it
    assert changed == set(compat.applied()), changed ^ set(compat.applied())
    listed = {e.path for e in compat.INTERNALS if e.patched or e.added}
    names = {path.rpartition(".")[2]: path for path in listed}
    for path in compat.applied():  # each one a listed internal, or a module's own reference to a listed function
        path = path.partition("[")[0]  # an entry of a listed mapping
        assert path in listed or names.get(path.rpartition(".")[2], "").count(".") > 1, path
    with pytest.raises(KeyError, match="not listed"):
        compat.patch("transformers.modeling_utils.PreTrainedModel.from_pretrained", None)
    with pytest.raises(KeyError, match="relied on, not patched"):
        compat.patch("transformers.trainer.Trainer.log", None)
    with pytest.raises(KeyError, match="not as added"):
        compat.add("transformers.trainer.Trainer.log", None)


def test_a_patch_outside_compat_is_found():
    from transformers import Trainer

    def stray(self):  # defined here, so not hf_primal's: give it hf_primal's module name as a stray patch would
        return None

    stray.__module__ = "hf_primal.integration.patching"
    Trainer._stray_hook = stray
    try:
        assert "transformers.trainer.Trainer._stray_hook" in _hf_primal_attributes()
    finally:
        del Trainer._stray_hook


def test_an_added_attribute_transformers_already_has_is_refused(monkeypatch):
    entry = compat.Internal("transformers.trainer.Trainer.log", "probe", added=True)
    with pytest.raises(compat.IncompatibleTransformersError, match="already has an attribute of its own"):
        compat.check_transformers((entry,))


def test_import_fails_clearly_when_transformers_lacks_a_hooked_internal():
    code = (
        "from transformers.generation.utils import GenerationMixin\n"
        "del GenerationMixin._prepare_cache_for_generation\n"
        "import hf_primal\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("hf_primal.integration.compat.IncompatibleTransformersError")
    assert "GenerationMixin._prepare_cache_for_generation" in last
    assert f"installed transformers {transformers.__version__}" in last and compat.TRANSFORMERS_RANGE in last


@pytest.mark.parametrize("version, warns", [("4.57.6", True), ("6.0.0", True), (None, False)])
def test_versions_outside_the_range_warn(version, warns, monkeypatch):
    if version is not None:
        monkeypatch.setattr(compat, "_installed_version", lambda: version)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compat.check_transformers()
    messages = [str(w.message) for w in caught if "outside that range" in str(w.message)]
    assert bool(messages) == warns
    if warns:
        assert version in messages[0] and compat.TRANSFORMERS_RANGE in messages[0]


def test_trainer_attributes_are_checked():
    class NotATrainer:
        accelerator = None

    with pytest.raises(
        compat.IncompatibleTransformersError,
        match=r"\['model_accepts_loss_kwargs', 'compute_loss_func', 'loss_is_scaled_for_ga'\]",
    ):
        compat.check_trainer_instance(NotATrainer())


def test_ci_tests_the_lowest_supported_release():
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        lowest = re.search(r"^LOWEST_TRANSFORMERS=(\S+)$", f.read(), flags=re.M).group(1)
    bound = re.search(r">=([\d.]+)", compat.TRANSFORMERS_RANGE).group(1)
    assert Version(lowest) == Version(bound)


def test_config_instance_attributes_exist():
    from transformers import BertConfig

    config = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    assert all(hasattr(config, name) for name, _ in compat.CONFIG_ATTRIBUTES)


def _private_names_read_outside_compat():
    """Private attribute names the package reads (``x._name``, ``getattr(x, "_name")``, ``from m import _name``)
    that it does not define itself, with the files reading them. Names of hf_primal's own markers
    (``_primal*``, ``_is_primal*``, ``_hf_primal*``) and dunders are not transformers internals."""
    import ast

    package = Path(ROOT) / "hf_primal"
    used, defined = {}, set()
    own = ("_primal", "_is_primal", "_hf_primal")
    for path in package.rglob("*.py"):
        if path.name == "compat.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Name):
                        defined.add(target.id)
                    elif isinstance(target, ast.Attribute) and getattr(target.value, "id", None) in ("self", "cls"):
                        defined.add(target.attr)
            names = []
            if isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr") \
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                    and isinstance(node.args[1].value, str):
                names = [node.args[1].value]
            for name in names:
                if name.startswith("_") and not name.startswith("__") and not name.startswith(own):
                    used.setdefault(name, set()).add(str(path.relative_to(package)))
    return {name: files for name, files in used.items() if name not in defined}


def test_every_private_name_the_package_reads_is_listed_in_compat():
    listed = {part for entry in compat.INTERNALS for part in entry.path.split(".")}
    listed |= {name for name, _ in compat.CONFIG_ATTRIBUTES}
    unlisted = {name: sorted(files) for name, files in _private_names_read_outside_compat().items()
                if name not in listed}
    assert not unlisted, f"transformers / torch internals read outside compat.INTERNALS: {unlisted}"


def test_the_private_name_scan_sees_what_it_should():
    # Known readers: hub.py registers `_can_record_outputs`, layers.py imports `_active_collector`.
    found = _private_names_read_outside_compat()
    assert "integration/hub.py" in found["_can_record_outputs"]
    assert "modeling/layers.py" in found["_active_collector"]

"""Packaging and layering: every sub-package is listed, nothing imports upward, and the top
level stays light."""

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = {"aviatorc": ROOT / "aviatorc", "aviatorc.passes": ROOT / "passes", "aviatorc.backends": ROOT / "backends"}


def _packages_on_disk() -> set[str]:
    found = set()
    for prefix, root in SOURCE_ROOTS.items():
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root)
            found.add(".".join([prefix, *rel.parts]) if rel.parts else prefix)
    return found


def test_every_package_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    missing = _packages_on_disk() - listed
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"


def test_no_top_level_passes_package_is_importable_by_accident():
    # passes/ must be reached as aviatorc.passes; a bare `import passes` would leak a generic name.
    code = "import importlib.util, sys; sys.path = [p for p in sys.path if p not in ('', '.')]; " \
           "print(importlib.util.find_spec('passes') is None)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.stdout.strip() == "True"


def test_the_checkout_imports_its_mapped_packages_without_an_install():
    # `python` in the checkout's root imports this folder's aviatorc, not the installed one (the
    # README's "From Python" after a user install); no site-packages here, so no editable finder.
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); import importlib.util as u; "
            "print(u.find_spec('aviatorc.passes').origin, u.find_spec('aviatorc.backends').origin)")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd="/")
    assert out.stdout.split() == [str(ROOT / "passes" / "__init__.py"), str(ROOT / "backends" / "__init__.py")], \
        out.stderr


# Each layer may import only the layers below it (STYLE.md).
LAYERS = [
    {"aviatorc.errors", "aviatorc.progress"},
    {"aviatorc.ir", "aviatorc.target", "aviatorc.formats", "aviatorc.options", "aviatorc.extras"},
    {"aviatorc.passes", "aviatorc.frontends", "aviatorc.quant", "aviatorc.accuracy", "aviatorc.models", "aviatorc.zoo",
     "aviatorc.workload", "aviatorc.routing"},
    {"aviatorc.partition", "aviatorc.schedule", "aviatorc.plan"},
    {"aviatorc.backends", "aviatorc.report", "aviatorc.runtime", "aviatorc.inspect", "aviatorc.exporter"},
    {"aviatorc.compiler", "aviatorc.serve", "aviatorc.cli", "aviatorc.terminal", "aviatorc.__main__", "aviatorc"},
]


def _layer_of(module: str) -> int:
    best = None
    for index, layer in enumerate(LAYERS):
        for name in layer:
            if module == name or module.startswith(name + "."):
                if best is None or len(name) > best[1]:
                    best = (index, len(name))
    return best[0] if best else len(LAYERS) - 1


def _modules():
    for prefix, root in SOURCE_ROOTS.items():
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            yield ".".join([prefix, *parts]), path


def test_layers_import_only_downward():
    problems = []
    for module, path in _modules():
        own = _layer_of(module)
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                if name.startswith("aviatorc") and name != "aviatorc" and _layer_of(name) > own:
                    problems.append(f"{module} imports {name}")
    assert not problems, "upward imports:\n" + "\n".join(problems)


def test_ir_imports_no_heavy_library():
    code = "import sys, aviatorc.ir; print(sorted(m for m in ('torch', 'onnx', 'ortools', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _imports(path: Path) -> set[str]:
    """The aviatorc modules a file imports (at any depth: function-level imports count)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in names if n.startswith("aviatorc")}


def test_the_runtime_reaches_the_backends_only_through_their_contract():
    problems = []
    for module, path in _modules():
        if module.startswith("aviatorc.runtime"):
            for name in _imports(path):
                if name.startswith("aviatorc.backends") and not name.startswith("aviatorc.backends.contract"):
                    problems.append(f"{module} imports {name}")
    assert not problems, "use aviatorc.backends.contract:\n" + "\n".join(problems)


def test_no_import_cycle_between_the_packages_of_a_layer():
    """Packages of one layer may import each other (runtime -> backends, schedule -> plan), but
    never both ways: what both need goes into a module below them or a contract module."""
    import networkx as nx

    modules = dict(_modules())
    packages = {m for m, p in modules.items() if p.name == "__init__.py"}

    def package_of(module: str) -> str:
        return module if module in packages else module.rsplit(".", 1)[0]

    graph = nx.DiGraph()
    for module, path in modules.items():
        for name in _imports(path):
            target = name if name in modules else name.rsplit(".", 1)[0]
            if target not in modules:
                continue
            a, b = package_of(module), package_of(target)
            related = a == b or a.startswith(b + ".") or b.startswith(a + ".") or "aviatorc" in (a, b)
            if not related and _layer_of(a) == _layer_of(b):
                graph.add_edge(a, b, via=f"{module} imports {name}")
    cycles = list(nx.simple_cycles(graph))
    described = [" -> ".join(c) + "  (" + "; ".join(graph.edges[a, b]["via"] for a, b in zip(c, c[1:] + c[:1])) + ")"
                 for c in cycles[:5]]
    assert not cycles, "import cycles between packages of a layer:\n" + "\n".join(described)


def test_each_extra_installs_what_its_error_names():
    """aviatorc/extras.py (the error naming `pip install 'aviatorc[X]'`) and pyproject's extras list the
    same distributions, so the install the error suggests brings what was missing."""
    from aviatorc.extras import EXTRAS

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = config["project"]["optional-dependencies"]
    for extra, packages in EXTRAS.items():
        names = {req.split(">")[0].split("=")[0].split("<")[0].strip() for req in declared[extra]}
        assert names == {dist for _, dist in packages}, f"[{extra}]: pyproject {sorted(names)}, extras.py {packages}"


def test_a_missing_extra_is_a_user_error_naming_it(monkeypatch):
    import importlib.util

    import pytest

    from aviatorc.errors import OptionError
    from aviatorc.extras import require

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(OptionError) as info:
        require("gguf", "reading the GGUF file 'm.gguf'")
    assert str(info.value) == ("reading the GGUF file 'm.gguf' needs the gguf package; pip install 'aviatorc[gguf]' "
                               "(from a checkout: pip install '.[gguf]')")


def test_the_readme_test_command_prints_its_count():
    """pyproject's addopts leave pytest's closing line (`== N passed in Xs ==`), which CI reads."""
    done = subprocess.run([sys.executable, "-m", "pytest", "tests/passes/test_cleanup.py"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    last = done.stdout.strip().splitlines()[-1]
    import re

    assert done.returncode == 0 and re.fullmatch(r"=+ \d+ passed in [\d.]+s( \([\d:]+\))? =+", last), last

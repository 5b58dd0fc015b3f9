"""Architecture: the import contracts in pyproject.toml hold (lint-imports: the layers
analysis > bench > systems > workloads, the layers inside bench and systems, no import cycles
among sibling modules), a broken contract is caught, and no module imports another module's
private name."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("analysis", "bench", "systems", "workloads")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
CONTRACTS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def lint_imports(root: Path, *args: str) -> subprocess.CompletedProcess:
    """`lint-imports --no-cache` on the tree at `root` (its pyproject.toml, its packages)."""
    assert LINT_IMPORTS.is_file(), (f"{LINT_IMPORTS} missing: import-linter is a pinned dependency, "
                                     "run scripts/setup_env.sh")
    env = dict(os.environ, PYTHONPATH=str(root), COLUMNS="400", NO_COLOR="1")   # wide: no wrapped module names
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo", "--config", str(root / "pyproject.toml"),
                           *args], cwd=root, env=env, capture_output=True, text=True, timeout=120)


def _contract(contract_id: str) -> dict:
    (c,) = [c for c in CONTRACTS if c["id"] == contract_id]
    return c


# --------------------------------------------------------------------------- lint-imports on this tree

def test_contracts_configured():
    layers = _contract("layers")
    assert layers["layers"] == list(ROOTS)                         # top to bottom
    assert set(ROOTS) | {"bench.sim"} <= set(_contract("acyclic")["ancestors"])


@pytest.mark.parametrize("contract", [c["id"] for c in CONTRACTS])
def test_contract_kept(contract):
    proc = lint_imports(REPO, "--contract", contract)
    assert proc.returncode == 0, (f"lint-imports --contract {contract} exited {proc.returncode}:\n"
                                  f"{proc.stdout}{proc.stderr}")


# --------------------------------------------------------------------------- a broken contract fails

def _hollow_copy(dest: Path) -> Path:
    """This tree's packages and modules, every module empty (no imports), plus pyproject.toml: a baseline
    that keeps every contract whatever state the real modules are in. The real tree is never touched."""
    for root in ROOTS:
        for src in (REPO / root).rglob("*.py"):
            if "__pycache__" not in src.parts:
                out = dest / src.relative_to(REPO)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text('"""hollow"""\n')
    shutil.copy(REPO / "pyproject.toml", dest / "pyproject.toml")
    return dest


PROBES = {   # probe -> (files to add, the contract it breaks, a line lint-imports must print)
    "none": ({}, None, None),
    "upward": ({"workloads/_layer_probe_tmp.py": "import bench\n"},
               "layers", "workloads._layer_probe_tmp -> bench (l.1)"),
    "lazy-upward": ({"systems/_layer_probe_tmp.py": "def f():\n    import analysis\n"},
                    "layers", "systems._layer_probe_tmp -> analysis (l.2)"),
    "cycle": ({"bench/sim/_cycle_probe_a.py": "from bench.sim import _cycle_probe_b\n",
               "bench/sim/_cycle_probe_b.py": "import bench.sim._cycle_probe_a\n"},
              "acyclic", "_cycle_probe_"),
}


@pytest.mark.parametrize("probe", PROBES)
def test_broken_contract_fails(tmp_path, probe):
    files, broken_id, line = PROBES[probe]
    root = _hollow_copy(tmp_path)
    for name, text in files.items():
        (root / name).write_text(text)
    proc = lint_imports(root)
    out = proc.stdout + proc.stderr
    if broken_id is None:
        assert proc.returncode == 0, out
        return
    assert proc.returncode != 0, out
    name = _contract(broken_id)["name"]
    assert f"{name} BROKEN" in out, out
    assert line in out, out
    for other in CONTRACTS:
        if other["id"] != broken_id:
            assert f"{other['name']} KEPT" in out, out


# --------------------------------------------------------------------------- private names

def _private(component: str) -> bool:
    """A leading underscore, not a dunder (`_mcore`, `_helper`, `__x`; not `__main__`, `__version__`)."""
    return component.startswith("_") and not (component.startswith("__") and component.endswith("__"))


def _module_name(path: Path, root: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _is_package(dotted: str, root: Path) -> bool:
    d = root.joinpath(*dotted.split("."))
    return d.is_dir() and not d.with_suffix(".py").is_file()


def _within(importer: str, container: str, root: Path) -> bool:
    """Whether `importer` may use `container`'s private names: the module itself, or, for a package, any
    module inside it (its __init__, its modules, its subpackages)."""
    if importer == container:
        return True
    return _is_package(container, root) and importer.startswith(container + ".")


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool) -> list[tuple[str, str]]:
    """(dotted target, how the source spells it) for each name the statement imports."""
    if isinstance(node, ast.Import):
        return [(a.name, f"import {a.name}") for a in node.names]
    if node.level:
        base = importer.split(".") if is_package else importer.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    spelled = "." * node.level + (node.module or "")
    return [(f"{module}.{a.name}", f"from {spelled} import {a.name}") for a in node.names if a.name != "*"]


def private_imports(root: Path) -> list[str]:
    """Every import, at module level or lazy inside a function, of a private name (function, class,
    module, constant) of one of our packages by a module outside the package that directly contains it."""
    offenders: dict[tuple[str, int, str], str] = {}     # (file, line, why) -> the first name: one per statement
    for top in ROOTS:
        for path in sorted((root / top).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            importer, is_package = _module_name(path, root)
            try:
                tree = ast.parse(path.read_text(), filename=str(path))
            except SyntaxError as e:
                offenders[(str(path.relative_to(root)), e.lineno or 0, e.msg)] = "cannot parse"
                continue
            for node in ast.walk(tree):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                for target, spelled in _targets(node, importer, is_package):
                    parts = target.split(".")
                    if parts[0] not in ROOTS:
                        continue                                # third-party privates are not ours to police
                    for i in range(1, len(parts)):
                        container = ".".join(parts[:i])
                        if _private(parts[i]) and not _within(importer, container, root):
                            why = f"{'.'.join(parts[:i + 1])} is private to {container}"
                            offenders.setdefault((str(path.relative_to(root)), node.lineno, why), spelled)
                            break
    return [f"{file}:{line}: {offenders[file, line, why]} ({why})" for file, line, why in sorted(offenders)]


def test_no_private_names_imported_across_modules():
    offenders = private_imports(REPO)
    assert not offenders, "imports of another module's private name:\n  " + "\n  ".join(offenders)


def test_private_name_check_catches_what_it_should(tmp_path):
    files = {
        "systems/__init__.py": "",
        "systems/_mcore.py": "def _helper(): pass\ndef build(): pass\n",
        "systems/megatron.py": "from systems import _mcore\nimport systems._mcore\nfrom ._mcore import build\n",
        "systems/disttrain/__init__.py": "def _shared(): pass\n",
        "systems/disttrain/runtime.py": "from systems._mcore import build\nfrom . import _shared\n"
                                        "from systems.disttrain import _shared as s\n",
        "systems/base.py": "from systems._mcore import _helper\n",                         # 1: private function
        "bench/__init__.py": "",
        "bench/profile/__init__.py": "",
        "bench/profile/measure.py": "def f():\n    from systems import _mcore\n"              # 2: lazy, module
                                    "import systems._mcore as m\n"                            # 3: import a._b
                                    "from systems._mcore import build\n"                      # 4: through it
                                    "from systems.disttrain import _shared\n"                 # 5: package-private
                                    "from ..sim import _x\n"                                  # 6: relative
                                    "from . import _y\nfrom .. import _z\n"                 # within: allowed
                                    "from analysis.__main__ import main\nfrom torch import _C\n",
        "bench/profile/_y.py": "",
        "bench/_z.py": "",
        "bench/sim/__init__.py": "",
        "bench/sim/_x.py": "",
        "analysis/__init__.py": "",
        "analysis/__main__.py": "def main(): pass\n",
        "workloads/__init__.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = private_imports(tmp_path)
    assert [f.split(": ", 1)[1] for f in found] == [
        "from systems import _mcore (systems._mcore is private to systems)",
        "import systems._mcore (systems._mcore is private to systems)",
        "from systems._mcore import build (systems._mcore is private to systems)",
        "from systems.disttrain import _shared (systems.disttrain._shared is private to systems.disttrain)",
        "from ..sim import _x (bench.sim._x is private to bench.sim)",
        "from systems._mcore import _helper (systems._mcore._helper is private to systems._mcore)",
    ], found
    assert all(f.startswith(("bench/profile/measure.py:", "systems/base.py:1:")) for f in found), found

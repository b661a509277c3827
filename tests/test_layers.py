"""The layer rule of docs/architecture.md, enforced on the source (``ast``, no imports run).

Layers (read from the doc's "Layers" list, so the page and this test cannot drift):
1 wire (``common/wire/``), 2 runtime, link and storage (``common/runtime/``, ``common/link/``,
``common/storage/``), 3 daemons and the library (package folders), 4 operator tools
(``common/tools/`` and the console). A module may import its
own layer and the layers below; a layer-3 package never imports another layer-3 package;
layer 4 may import anything. Exceptions are listed below, each with its reason.
Also: no module cites the first contract's file, which is not in the repository.
"""

from __future__ import annotations

import ast
import configparser
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"

#: Imports that break the rule on purpose: (importing module, imported module) -> why.
#: Each is written down in docs/architecture.md ("Layers" and "Known debts").
EXCEPTIONS: dict[tuple[str, str], str] = {}
#: The read-only exception of layer 3 ("the operator tools and the console read the ledger
#: through brokerd/ledger/ and brokerd/report.py"): every reader of it sits on layer 4 today,
#: where any import is allowed; a daemon (layer 3) reading the ledger would need a row in
#: EXCEPTIONS above, and these are the only brokerd modules such a row may name.
READ_ONLY_LEDGER = frozenset({"ccsq.brokerd.ledger", "ccsq.brokerd.report"})


def _layers_from_doc() -> tuple[dict[str, int], dict[str, int]]:
    """(``common`` sub-package -> layer, package folder -> layer) from the doc's numbered list."""
    text = ARCHITECTURE.read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    items = re.split(r"\n(?=\d\. \*\*)", section)
    subpackages: dict[str, int] = {}
    folders: dict[str, int] = {}
    for item in items:
        m = re.match(r"(\d)\. \*\*", item)
        if not m:
            continue
        layer = int(m.group(1))
        for name in re.findall(r"`common/(\w+)/`", item):
            subpackages.setdefault(name, layer)
        for name in re.findall(r"`(\w+)/`", item):
            folders.setdefault(name, layer)
    return subpackages, folders


def _packages() -> dict[str, Path]:
    """ccsq sub-package name -> folder, from setup.cfg ``package_dir``."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    out = {}
    for line in cfg["options"]["package_dir"].strip().splitlines():
        name, _, folder = (part.strip() for part in line.partition("="))
        out[name.removeprefix("ccsq.")] = ROOT / folder
    return out


def _module_name(package: str, path: Path, folder: Path) -> str:
    rel = path.relative_to(folder).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(["ccsq", package, *parts])


def _ccsq_imports(path: Path, module: str) -> set[str]:
    """Every ccsq module ``path`` imports (top level or inside functions), as dotted names."""
    found: set[str] = set()
    package = module.rsplit(".", 1)[0] if not path.name == "__init__.py" else module
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("ccsq."))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if not base.startswith("ccsq"):
                continue
            found.add(base)
            for alias in node.names:  # `from ccsq.common.wire import protocol` names a module
                found.add(f"{base}.{alias.name}")
    return found


def _layer_of(module: str, common_layers: dict[str, int], folder_layers: dict[str, int]) -> int | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None
    if parts[1] == "common":
        return common_layers.get(parts[2]) if len(parts) > 2 else 1  # by sub-package
    return folder_layers.get(parts[1])


def test_every_import_follows_the_layer_rule() -> None:
    common_layers, folder_layers = _layers_from_doc()
    assert {"wire", "runtime", "link", "storage", "tools"} <= set(common_layers), "docs/architecture.md lost its layer list"
    problems: list[str] = []
    for package, folder in _packages().items():
        if package != "common" and package not in folder_layers:
            problems.append(f"package folder {folder.name}/ is in setup.cfg but in no layer of docs/architecture.md")
            continue
        for path in sorted(folder.rglob("*.py")):
            module = _module_name(package, path, folder)
            own = _layer_of(module, common_layers, folder_layers)
            if own is None:
                if path.name != "__init__.py":
                    problems.append(f"{path.relative_to(ROOT)} is in no layer of docs/architecture.md: place it there")
                continue
            for target in sorted(_ccsq_imports(path, module)):
                if target.startswith("ccsq.tests"):
                    problems.append(f"{module} imports test code {target}")
                    continue
                layer = _layer_of(target, common_layers, folder_layers)
                if layer is None or (module, target) in EXCEPTIONS:
                    continue  # an unplaced target is reported on its own file
                if own == 4:
                    continue  # operator tools may import any daemon package
                same_package = target.split(".")[1] == package
                if layer > own:
                    problems.append(f"{module} (layer {own}) imports {target} (layer {layer}): imports run down")
                elif own == 3 and layer == 3 and not same_package:
                    problems.append(f"{module} imports another daemon's package: {target}")
    assert not problems, "layer rule (docs/architecture.md) broken:\n" + "\n".join(problems)


def test_the_exceptions_are_still_needed_and_documented() -> None:
    """A stale exception hides the next break; each one is written down in the doc."""
    doc = ARCHITECTURE.read_text()
    packages = _packages()
    for importer, target in EXCEPTIONS:
        package, rest = importer.split(".")[1], importer.split(".")[2:]
        path = packages[package].joinpath(*rest).with_suffix(".py")
        assert target in _ccsq_imports(path, importer), f"exception {importer} -> {target} is no longer needed"
        for dotted in (importer, target):
            assert f"`{dotted.split('.', 1)[1].replace('.', '/')}.py`" in doc, f"{dotted} is not in docs/architecture.md"
    for module in READ_ONLY_LEDGER:  # a package is named by its folder (`brokerd/ledger/`), a module by its file
        rel = module.split(".", 1)[1].replace(".", "/")
        package, *rest = module.split(".")[1:]
        is_package = packages[package].joinpath(*rest).is_dir()
        assert (f"`{rel}/`" if is_package else f"`{rel}.py`") in doc, f"{module} is not in docs/architecture.md"


def test_no_module_cites_the_design_file_outside_the_repository() -> None:
    name = "DESIGN" + ".md"  # spelled apart so this file does not cite it
    pattern = re.compile(r"\bDESIGN(\.md\b|\s+\")")
    cites = []
    tops = [d for d in ROOT.iterdir() if d.is_dir() and not d.name.startswith(".") and d.name not in ("build", "dist")]
    paths = [*ROOT.glob("*.py"), *(p for top in tops for p in top.rglob("*.py") if "site-packages" not in p.parts)]
    for path in sorted(paths):
        rel = path.relative_to(ROOT)
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                cites.append(f"{rel}:{lineno}: {line.strip()}")
    assert not cites, f"cite docs/architecture.md or a docs/ page, not {name}:\n" + "\n".join(cites)

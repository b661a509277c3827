"""The layer rule of docs/architecture.md, as import-linter contracts (pyproject.toml
``[tool.importlinter]``), and the page kept in step with them.

The contracts themselves run over the installed package in tests/test_static_checks.py
(``lint-imports``; a planted bad import per contract shows each one bites). Here: the
page's "Layers" list and the contracts name the same folders in the same order, every
package folder of setup.cfg is in a layer, each way the tools reach into ``brokerd/`` is
written on the page, ``bench/`` imports no test file, and no module cites the first
contract's file, which is not in the repository.
"""

from __future__ import annotations

import ast
import configparser
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
CONTRACTS = {c["id"]: c for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]}


def _doc_layers() -> list[set[str]]:
    """The folders of each numbered item of the doc's "Layers" list, top layer first."""
    section = ARCHITECTURE.read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers: dict[int, set[str]] = {}
    for item in re.split(r"\n(?=\d\. \*\*)", section):
        m = re.match(r"(\d)\. \*\*", item)
        if m:
            # the folders a layer is made of: `common/wire/`, `brokerd/` (not `brokerd/ledger/`),
            # in the item's own paragraph
            layers[int(m.group(1))] = set(re.findall(r"`((?:common/)?\w+)/`", item.split("\n\n", 1)[0])) - {"common"}
    return [layers[n] for n in sorted(layers, reverse=True)]


def _contract_layers() -> list[set[str]]:
    """The folders of each layer of the ``layers`` contract, top layer first."""
    return [{m.strip().replace(".", "/") for m in re.split(r"[|:]", layer)} for layer in CONTRACTS["layers"]["layers"]]


def _package_folders() -> set[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options"]["package_dir"].strip().splitlines()
    return {line.partition("=")[2].strip() for line in lines}


def test_the_contracts_and_the_page_name_the_same_layers() -> None:
    doc, contract = _doc_layers(), _contract_layers()
    assert len(doc) == 4, "docs/architecture.md lost its layer list"
    assert doc == contract, f"docs/architecture.md (top first): {doc}\npyproject.toml layers contract: {contract}"
    common = [{f"common/{m.strip()}" for m in re.split(r"[|:]", layer)} for layer in CONTRACTS["common-layers"]["layers"]]
    assert common == [layer & {f for f in layer if f.startswith("common/")} for layer in contract if
                      any(f.startswith("common/") for f in layer)]


def test_every_package_folder_is_in_a_layer() -> None:
    placed = set().union(*_contract_layers())
    missing = {folder for folder in _package_folders() if folder != "common" and folder not in placed}
    assert not missing, f"package folders in no layer of the contract (pyproject.toml): {sorted(missing)}"
    independent = {m.removeprefix("ccsq.") for m in CONTRACTS["daemons-independent"]["modules"]}
    assert independent == _contract_layers()[1], "the independence contract names other packages than layer 3"


def test_each_reach_of_the_tools_into_brokerd_is_on_the_page() -> None:
    doc = ARCHITECTURE.read_text()
    for rule in CONTRACTS["tools-read-the-broker"]["ignore_imports"]:
        target = rule.split("->")[1].strip().removeprefix("ccsq.").replace(".", "/")
        named = f"`{target}/`" if (ROOT / target).is_dir() else f"`{target}.py`"
        assert named in doc, f"{rule}: {named} is not in docs/architecture.md"


def test_bench_imports_no_test_file() -> None:
    """bench/ may use the test harnesses (tests/*_harness.py, tests/swarm.py, ...), never a test module."""
    bad = []
    for path in sorted((ROOT / "bench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in names if re.match(r"tests\.(.*\.)?test_\w+$", n)]
    assert not bad, "move what bench needs into a support module (not a test file):\n" + "\n".join(bad)


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

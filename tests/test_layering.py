"""The packages stand in floors, and no import runs back up one (read from the source, with ast).

- `trident/wire/` is the floor: what crosses process boundaries. It imports nothing of
  trident above it and no process package.
- The process packages (`tokenizer_proc`, `scheduler_proc`, `gpu_worker`) stand on it: each
  imports `trident.wire`, never another process package and never trident's roof (launch,
  supervisor, engine...).
- trident's roof reaches a process package through one narrow interface each:
  `tokenizer_proc/offline.py` (the offline Engine) and `gpu_worker/model/model_check.py`
  (the launcher's model check); it never imports scheduler_proc.

Every import counts, those inside functions included: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator

from tests.helpers import REPO_ROOT

PROCESS_PACKAGES = ("tokenizer_proc", "scheduler_proc", "gpu_worker")
INTERFACES = {"tokenizer_proc": "tokenizer_proc.offline", "gpu_worker": "gpu_worker.model.model_check"}
"""The one module of each process package that trident's roof may import."""


def top(module: str) -> str:
    return module.split(".")[0]


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def imports_under(folder: str) -> Iterator[tuple[str, str, set[str]]]:
    """(file, imported module, names imported from it) for every import of every .py file under folder."""
    for dirpath, _, files in os.walk(os.path.join(REPO_ROOT, folder)):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, REPO_ROOT)
            with open(path) as f:
                tree = ast.parse(f.read(), rel)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    for alias in node.names:
                        yield rel, alias.name, set()
                elif isinstance(node, ast.ImportFrom):
                    assert node.level == 0, f"{rel}: a relative import; the layering rules read absolute ones"
                    yield rel, node.module or "", {alias.name for alias in node.names}


def ours(module: str) -> bool:
    return top(module) in ("trident", *PROCESS_PACKAGES)


def test_wire_imports_no_process_package_and_nothing_of_trident_above_it():
    bad = [(f, m) for f, m, _ in imports_under("trident/wire") if ours(m) and not within(m, "trident.wire")]
    assert bad == []


def test_no_process_package_imports_another_or_tridents_roof():
    bad = []
    for package in PROCESS_PACKAGES:
        for f, m, names in imports_under(package):
            if not ours(m) or within(m, package) or within(m, "trident.wire"):
                continue
            bad.append((f, m, sorted(names)))
    assert bad == []


def test_trident_reaches_each_process_package_through_its_one_interface():
    bad = []
    for f, m, names in imports_under("trident"):
        if f.startswith(os.path.join("trident", "wire", "")) or top(m) not in PROCESS_PACKAGES:
            continue
        interface = INTERFACES.get(top(m))
        from_interface = m == interface or (interface is not None and {f"{m}.{n}" for n in names} == {interface})
        if not from_interface:
            bad.append((f, m))
    assert bad == []


def test_the_rules_see_the_imports_they_govern():
    """The walk finds the interfaces in use, so the tests above are not passing on an empty set."""
    seen = {m for f, m, _ in imports_under("trident") if top(m) in PROCESS_PACKAGES}
    assert seen == set(INTERFACES.values())
    assert any(within(m, "trident.wire") for package in PROCESS_PACKAGES for _, m, _ in imports_under(package))

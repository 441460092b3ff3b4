"""DESIGN.md's "Layers" table, checked: every module of ours imports only the packages its row allows."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOT_SCANNED = {"tests", "bench", "examples", "infra"}  # not shipped: they may import anything

# Imports the table does not allow yet, as (module, imported module), each with why; the test fails on an entry
# that no longer occurs, so a stale one cannot hide a new violation.
PENDING: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Row:
    place: str  # "models/" or "activities/interface.py"
    allowed: frozenset[str]  # our packages or modules it may import; "*" for all
    never: frozenset[str]  # packages it may not import even as libraries

    @property
    def package(self) -> str:
        return self.place.removesuffix("/").removesuffix(".py").replace("/", ".")

    def covers(self, module: str) -> bool:
        return module == self.package or module.startswith(self.package + ".")


def parse_table(design: str) -> list[Row]:
    """The rows of the table under "## Layers": place → what its "may import" column names in backquotes."""
    section = design.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        place, may = cells[0].strip("`"), cells[2]
        allowed_part, _, never_part = may.partition("never")
        allowed = {"*"} if may.strip() == "all" else set(re.findall(r"`([\w.]+)`", allowed_part))
        rows.append(Row(place, frozenset(allowed), frozenset(re.findall(r"`([\w.]+)`", never_part))))
    return rows


def imports(source: str) -> list[tuple[int, str, list[str]]]:
    """Every absolute import in ``source``, at any depth: (line, module, the names taken from it)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module, [a.name for a in node.names]))
    return out


def modules(root: Path) -> dict[str, Path]:
    """Our modules under ``root``: the packages' and the top-level scripts', by dotted name."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in NOT_SCANNED or any(p.startswith(".") for p in rel.parts):
            continue
        if len(rel.parts) > 1 and not (root / rel.parts[0] / "__init__.py").exists():
            continue
        out[".".join(rel.with_suffix("").parts).removesuffix(".__init__")] = path
    return out


def breaches(root: Path, rows: list[Row]) -> list[tuple[str, int, str]]:
    """(module, line, what it imports) for each import its row does not allow; line 0 and "" for a module no
    row covers."""
    found = modules(root)
    ours = {name.split(".")[0] for name in found}
    out = []
    for name, path in found.items():
        covering = [r for r in rows if r.covers(name)]
        if not covering:
            out.append((name, 0, ""))
            continue
        row = max(covering, key=lambda r: len(r.package))
        own = row.package.split(".")[0] if row.place.endswith("/") else None
        for line, module, names in imports(path.read_text()):
            top = module.split(".")[0]
            if top in row.never:
                out.append((name, line, module))
                continue
            if top not in ours or top == own or "*" in row.allowed or _allows(row, module):
                continue
            # `from activities import interface` takes activities.interface: that spelling may be allowed
            for taken in [f"{module}.{n}" for n in names] or [module]:
                if not _allows(row, taken):
                    out.append((name, line, taken if taken in found else taken.rpartition(".")[0] or taken))
    return out


def violations(root: Path, rows: list[Row]) -> list[str]:
    return [f"{name}: no row of the Layers table covers it" if not line else f"{name}:{line} imports {taken}"
            for name, line, taken in breaches(root, rows) if (name, taken) not in PENDING]


def _allows(row: Row, module: str) -> bool:
    return any(module == a or module.startswith(a + ".") for a in row.allowed)


def test_every_module_imports_only_what_its_row_allows():
    rows = parse_table((ROOT / "DESIGN.md").read_text())
    assert {r.place for r in rows} >= {"models/", "rules/", "workflows/", "activities/", "backends/", "cli/"}
    assert violations(ROOT, rows) == []


def test_the_pending_list_holds_only_imports_that_still_occur():
    seen = {(name, taken) for name, _, taken in breaches(ROOT, parse_table((ROOT / "DESIGN.md").read_text()))}
    assert PENDING - seen == set(), "gone: take them off PENDING"


def test_activities_and_rules_do_not_reach_up_into_the_workflows():
    for name, path in modules(ROOT).items():
        if name.split(".")[0] in ("activities", "rules", "backends"):
            assert all(m.split(".")[0] != "workflows" for _, m, _ in imports(path.read_text())), name


TABLE = """## Layers

| place | holds | may import |
|---|---|---|
| `models/` | data | nothing of ours |
| `rules/` | pure rules | `models`, libraries; never `temporalio` |
| `workflows/` | workflows | `models`, `rules`, `activities.interface` (the stubs) |
| `activities/` | side effects | `models` |
| `activities/interface.py` | stubs | `models` |
| `worker.py` | the worker | all |

## Next
"""


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in ("models", "rules", "workflows", "activities"):
        (tmp_path / package).mkdir(exist_ok=True)
        (tmp_path / package / "__init__.py").touch()
    return tmp_path


def test_the_table_is_read_row_by_row():
    rows = {r.place: r for r in parse_table(TABLE)}
    assert rows["models/"].allowed == frozenset()
    assert rows["rules/"].allowed == {"models"} and rows["rules/"].never == {"temporalio"}
    assert rows["workflows/"].allowed == {"models", "rules", "activities.interface"}
    assert rows["worker.py"].allowed == {"*"}


def test_a_violating_import_is_reported_with_module_line_and_import(tmp_path):
    root = _tree(tmp_path, {
        "rules/plan.py": "import math\nfrom models import run\n\ndef f():\n    from workflows.service import W\n",
        "rules/clock.py": "from temporalio import workflow\n",
        "workflows/service.py": "from activities import interface\nfrom activities import local\n",
        "activities/interface.py": "from activities import local\n",
        "activities/local.py": "from activities import interface\nfrom rules.plan import f\n",
        "worker.py": "import workflows.service\nimport activities.local\n",
        "store/__init__.py": "",
    })
    assert sorted(violations(root, parse_table(TABLE))) == [
        "activities.interface:1 imports activities.local",  # a file's own row is stricter than its folder's
        "activities.local:2 imports rules.plan",
        "rules.clock:1 imports temporalio",
        "rules.plan:5 imports workflows.service",  # inside a function too
        "store: no row of the Layers table covers it",
        "workflows.service:2 imports activities.local",
    ]

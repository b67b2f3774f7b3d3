"""The shape the code keeps: short module docstrings (design prose lives in docs/DESIGN.md)
and one definition of each shared test fixture."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("sluice", "server", "balancer", "client")
SHARED_FIXTURES = ("engine", "cluster", "pair")


def product_modules() -> list[Path]:
    # rglob passes over the links in sluice/: each module is read once, at its real path.
    found = [p for top in PRODUCT for p in (ROOT / top).rglob("*.py") if "_pb2" not in p.name]
    assert len(found) > 50
    return found


def test_no_module_docstring_runs_over_fifteen_lines() -> None:
    long = {}
    for path in product_modules():
        doc = ast.parse(path.read_text()).body[:1]
        if doc and isinstance(doc[0], ast.Expr) and isinstance(doc[0].value, ast.Constant):
            lines = (doc[0].end_lineno or 0) - doc[0].lineno + 1
            if lines > 15:
                long[str(path.relative_to(ROOT))] = lines
    assert long == {}


def test_each_shared_fixture_is_defined_once() -> None:
    fixture = re.compile(r"@pytest(?:_asyncio)?\.fixture[^\n]*\n(?:async )?def (\w+)\(")
    defined = Counter(
        name
        for path in (ROOT / "tests").rglob("*.py")
        for name in fixture.findall(path.read_text())
        if name in SHARED_FIXTURES
    )
    assert defined and all(count == 1 for count in defined.values()), defined

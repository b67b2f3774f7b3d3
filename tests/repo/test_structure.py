"""The shape the code keeps: comments and docstrings short beside the code, short module
docstrings (design prose lives in docs/DESIGN.md) and one definition of each shared test
fixture."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("sluice", "server", "balancer", "client")
SHARED_FIXTURES = ("engine", "cluster", "pair")
MOST_PROSE = 0.16  # comment and docstring lines per line of code


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


def prose_and_code(source: str) -> tuple[int, int]:
    """Lines of comment or docstring alone, and the other non-blank lines."""
    prose: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                prose.update(range(body[0].lineno, (body[0].end_lineno or 0) + 1))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT and not token.line[: token.start[1]].strip():
            prose.add(token.start[0])
    lines = [n for n, line in enumerate(source.splitlines(), 1) if line.strip()]
    said = sum(n in prose for n in lines)
    return said, len(lines) - said


def test_comments_and_docstrings_stay_short_beside_the_code() -> None:
    counts = [prose_and_code(path.read_text()) for path in product_modules()]
    prose, code = sum(p for p, _ in counts), sum(c for _, c in counts)
    assert prose / code <= MOST_PROSE, f"{prose} lines of prose for {code} of code"

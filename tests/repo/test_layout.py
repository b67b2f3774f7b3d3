"""The two programs share one lifecycle and one set of listen settings (sluice.runtime): no
block of their mains, nor of their settings modules, is written twice, even with other
names, strings or numbers in it. So does their shared memory (sluice.shm.calls,
sluice.shm.setup): no block of the server's modules that take it is written again in
the balancer's."""

from __future__ import annotations

import ast
import dataclasses
import io
import keyword
import tokenize
from pathlib import Path

import pytest

from sluice.balancer.settings import BalancerSettings
from sluice.runtime.settings import ProgramSettings
from sluice.server.settings import ServerSettings

ROOT = Path(__file__).resolve().parents[2]
WINDOW = 6  # lines in a row: a block this long, written in both, is a copy
PAIRS = [("server/main.py", "balancer/main.py"), ("server/settings.py", "balancer/settings.py")]
PAIRS += [
    (server, "sluice/shm/balancer.py")
    for server in ("server/kserve.py", "server/v1.py", "server/service.py", "server/main.py")
]


def shapes(source: str) -> list[tuple[int, str]]:
    """Each line that says something, as (line number, its shape): names, strings and numbers
    replaced by placeholders; comments, blank lines, imports and the fields of a class left
    out (every settings field has the shape of the next: whether one field is declared twice
    is asked by name, below)."""
    imports = set()
    for node in ast.walk(ast.parse(source)):
        fields = (
            [f for f in node.body if isinstance(f, ast.AnnAssign)]
            if isinstance(node, ast.ClassDef)
            else []
        )
        for skipped in [node] if isinstance(node, ast.Import | ast.ImportFrom) else fields:
            imports.update(range(skipped.lineno, (skipped.end_lineno or skipped.lineno) + 1))
    lines: dict[int, list[str]] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NAME and not keyword.iskeyword(token.string):
            text = "N"
        elif token.type == tokenize.STRING:
            text = "S"
        elif token.type == tokenize.NUMBER:
            text = "0"
        elif token.type in (tokenize.OP, tokenize.NAME):
            text = token.string
        else:
            continue  # comments, newlines, indents
        row = token.start[0]
        if row not in imports:
            lines.setdefault(row, []).append(text)
    return [(row, " ".join(parts)) for row, parts in sorted(lines.items())]


def repeats(first: str, second: str, window: int = WINDOW) -> list[tuple[int, int]]:
    """Where a run of `window` line shapes of `first` appears in `second`: (line in first,
    line in second) of each run's start."""
    a, b = shapes(first), shapes(second)
    seen: dict[tuple[str, ...], int] = {}
    for i in range(len(b) - window + 1):
        seen.setdefault(tuple(s for _, s in b[i : i + window]), b[i][0])
    found = []
    for i in range(len(a) - window + 1):
        at = seen.get(tuple(s for _, s in a[i : i + window]))
        if at is not None:
            found.append((a[i][0], at))
    return found


def test_the_check_finds_a_copied_block_with_other_names() -> None:
    block = "\n".join(f"    value_{i} = settings.field_{i} + {i}" for i in range(WINDOW))
    first = f"import os\n\ndef one(settings):\n{block}\n    return 1\n"
    second = "def two(config):\n    # a comment\n\n" + block.replace("settings", "config")
    assert (4, 4) in repeats(first, second)
    assert repeats(first, second.replace("value_2 =", "value_2 +=")) == []


@pytest.mark.parametrize(("first", "second"), PAIRS)
def test_no_block_repeats_between_the_programs(first: str, second: str) -> None:
    found = repeats((ROOT / first).read_text(), (ROOT / second).read_text())
    assert found == [], f"{first} and {second} share blocks at lines {found}"


def test_no_setting_is_declared_by_both_programs() -> None:
    """A field both take lives in ProgramSettings; a program may declare one of those again
    only for another default (config.inherit: the same help). `workers` differs in kind:
    the server's takes auto (one per core, one on a GPU), the balancer's a number."""
    server, balancer = ServerSettings.__annotations__, BalancerSettings.__annotations__
    shared = {f.name: f for f in dataclasses.fields(ProgramSettings)}
    for name in server.keys() & balancer.keys():
        if name in shared:
            for cls in (ServerSettings, BalancerSettings):
                assert cls.__dataclass_fields__[name].metadata == shared[name].metadata
        else:
            assert name == "workers" and server[name] != balancer[name], name

"""The docs are written for a reader of the project and agree with what they describe: no
words that only make sense to whoever planned the work ("issue 12", "the GPU issue"), no
namespace fixed where the manifests fix none, the drain timing the manifests run, an index
that names every doc, and links and paths that lead somewhere."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
DEPLOY = ROOT / "deploy"
KUBERNETES = DOCS / "KUBERNETES.md"
INDEX = DOCS / "README.md"
# Every prose doc a user reads: the README, docs/, and the manifests' own README.
PROSE = [ROOT / "README.md", *sorted(DOCS.glob("*.md")), DEPLOY / "README.md"]

# A planned piece of work named by its number or by a nickname means nothing to a reader.
# "GitHub issue" (a link to a real one) and plain English ("a known issue") stay allowed.
TRACKER_WORDS = [
    re.compile(r"\bissues?\s*#\s*\d+", re.IGNORECASE),  # issue #12
    re.compile(r"\bissues?\s+\d+", re.IGNORECASE),  # issue 12, issues 9 and 12
    re.compile(r"\b(?:this|that)\s+issue\b", re.IGNORECASE),  # this goal
    # the GPU issue, the tracing issue's image; not "the GitHub issue" nor "a known issue"
    re.compile(r"\bthe\s+(?!github\b|known\b|open\b|upstream\b)[\w-]+\s+issue\b", re.IGNORECASE),
]

# `<service>.<namespace>.svc`: the namespace must be a placeholder, never a fixed one.
SVC_NAME = re.compile(r"\b[a-z0-9-]+\.([A-Za-z0-9<>_-]+)\.svc\b")
NAMESPACE_PLACEHOLDERS = {"NAMESPACE", "<namespace>"}

# Markdown links: [text](target); a target with a scheme or an anchor alone is not a file.
LINK = re.compile(r"\]\(([^)\s]+)\)")
# A path in backticks whose first part is a folder at the repository's root.
BACKTICKED = re.compile(r"`([^`\s]+)`")


def tracker_words(text: str) -> list[str]:
    """Each line that names planned work (a name wrapped over two lines counts on its
    first), as "line number: line"."""
    lines = text.splitlines()
    starts = sorted(
        text.count("\n", 0, match.start())
        for pattern in TRACKER_WORDS
        for match in pattern.finditer(text)
    )
    return [f"{i + 1}: {lines[i].strip()}" for i in dict.fromkeys(starts)]


@pytest.mark.parametrize("path", PROSE, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_name_no_planned_work(path: Path) -> None:
    assert tracker_words(path.read_text()) == []


def sources() -> list[Path]:
    """The project's Python and scripts, which a reader of the code reads too."""
    found = subprocess.run(
        ["git", "ls-files", "*.py", "scripts/*", "Dockerfile", "*.yaml", "*.toml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [ROOT / name for name in found if name != "tests/repo/test_docs.py"]


def test_code_names_no_planned_work() -> None:
    named: dict[str, list[str]] = {}
    for path in sources():
        if path.is_file() and (found := tracker_words(path.read_text(errors="replace"))):
            named[str(path.relative_to(ROOT))] = found
    assert named == {}


def test_the_planned_work_check_finds_what_it_is_for() -> None:
    text = (
        "Issue 12's goal\nsee issue #3\nissues 9 and 12\nthe GPU issue's image\n"
        "against this issue\nfile a GitHub issue\na known issue in grpc\nthe issue tracker\n"
        "wrapped: Issue\n13's goal, the GPU\nissue\n"
    )
    assert tracker_words(text) == [
        "1: Issue 12's goal",
        "2: see issue #3",
        "3: issues 9 and 12",
        "4: the GPU issue's image",
        "5: against this issue",
        "9: wrapped: Issue",
        "10: 13's goal, the GPU",
    ]


def test_kubernetes_doc_fixes_no_namespace() -> None:
    text = KUBERNETES.read_text()
    assert "default.svc" not in text
    fixed = [
        m.group(0) for m in SVC_NAME.finditer(text) if m.group(1) not in NAMESPACE_PLACEHOLDERS
    ]
    assert fixed == [], "the manifests name no namespace; neither may the doc"


def deployments() -> dict[str, dict[str, Any]]:
    found = {}
    for path in sorted(DEPLOY.glob("*.yaml")):
        for body in yaml.safe_load_all(path.read_text()):
            if body and body.get("kind") == "Deployment":
                found[body["metadata"]["name"]] = body
    return found


def drain_timing(deployment: dict[str, Any]) -> list[str]:
    """The row the doc's drain table must hold for one Deployment: preStop sleep, drain
    delay, grace and the termination grace period, as the manifest sets them."""
    pod = deployment["spec"]["template"]["spec"]
    (box,) = pod["containers"]
    args = box.get("args", [])
    flags = dict(zip(args[::2], args[1::2], strict=True))
    command = box.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    pre_stop = f"{command[1]} s" if command[:1] == ["sleep"] else "none"
    drain = f"{flags['--drain-delay-s']} s" if "--drain-delay-s" in flags else "none"
    return [pre_stop, drain, f"{flags['--grace-s']} s", f"{pod['terminationGracePeriodSeconds']} s"]


def table_rows(text: str) -> dict[str, list[str]]:
    """Markdown table rows keyed by their first cell's backticked name."""
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.lstrip().startswith("|") and re.fullmatch(r"`[\w-]+`", cells[0]):
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_kubernetes_doc_drain_timing_is_the_manifests() -> None:
    manifests = deployments()
    assert set(manifests) == {"sluice-server", "sluice-balancer"}
    rows = table_rows(KUBERNETES.read_text())
    for name, deployment in manifests.items():
        assert rows.get(name) == drain_timing(deployment), name


def test_kubernetes_doc_names_only_the_manifests_grace_periods() -> None:
    periods = {
        str(d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"])
        for d in deployments().values()
    }
    said = re.findall(r"terminationGracePeriodSeconds`?[:= ]+\s*(\d+)", KUBERNETES.read_text())
    assert said and set(said) <= periods, (said, periods)


def test_docs_index_links_every_doc() -> None:
    assert INDEX.exists(), "docs/README.md says where to start"
    linked = {(INDEX.parent / target).resolve() for target in LINK.findall(INDEX.read_text())}
    for doc in sorted(DOCS.glob("*.md")):
        if doc != INDEX:
            assert doc.resolve() in linked, f"docs/README.md does not link {doc.name}"
    assert (ROOT / "README.md").resolve() in linked
    assert (DEPLOY / "README.md").resolve() in linked


@pytest.mark.parametrize("path", PROSE, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_somewhere(path: Path) -> None:
    broken = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        if not (path.parent / target.split("#")[0]).exists():
            broken.append(target)
    assert broken == []


def test_design_names_only_paths_that_exist() -> None:
    """DESIGN.md's layout and module table name files by their path from the root."""
    tops = {entry.name for entry in ROOT.iterdir() if not entry.name.startswith(".")}
    missing = []
    for token in BACKTICKED.findall((DOCS / "DESIGN.md").read_text()):
        first = token.split("/")[0]
        if "/" not in token or first not in tops or first == token.rstrip("/"):
            continue
        if not any(ROOT.glob(token.rstrip("/"))):
            missing.append(token)
    assert missing == []

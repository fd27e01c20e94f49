"""The operator's page answers every alert, and the docs stand on their own: no file outside
the repository, no internal issue numbers, and every repository path they name exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_alert_has_its_section_in_the_operations_page() -> None:
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    alerts = [r["alert"] for group in rules["groups"] for r in group["rules"] if "alert" in r]
    page = (ROOT / "docs" / "operations.md").read_text()
    sections = re.findall(
        r"^### (\S+)$", page.split("## When an alert fires", 1)[1].split("\n## ", 1)[0], re.M
    )
    assert sections == alerts
    for alert in alerts:
        body = page.split(f"### {alert}\n", 1)[1].split("\n#", 1)[0]
        assert len(body.split()) > 40, f"{alert}: say what to do"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_cite_nothing_outside_the_repository(doc: Path) -> None:
    text = doc.read_text()
    assert not re.search(r"\.\./|/work/|\bshared/", text), "a path outside the repository"
    assert not re.search(r"\b[Ii]ssues? ?#?\d+|\bPR ?#?\d+|(?<![\w&`])#\d+\b", text), (
        "an internal issue number"
    )


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_repository_paths_in_docs_exist(doc: Path) -> None:
    text = doc.read_text()
    named = set(
        re.findall(r"(?<![\w./-])((?:deploy|docs|tests|bench|tokenyard)/[\w./-]*\w)(?![\w*])", text)
    )
    missing = [p for p in sorted(named) if not (ROOT / p).exists() and "*" not in p]
    assert not missing, missing

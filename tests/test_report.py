"""docs/benchmarks.md is what ``benchmarks/report.py`` prints, and every figure it shows is there.

The cheap subset: the ``files`` section (three bench runs with --parity, a
few seconds). The variant families are checked by hand with
``python benchmarks/report.py --check std,gpu,tail``. When this fails after
a change to a policy, the simulator or the files, the doc is stale:
regenerate it with ``python benchmarks/report.py`` and commit it with the
figures.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
REPORT = ROOT / "benchmarks" / "report.py"
SECTIONS = ("files", "std", "gpu", "tail", "steps")  # at least these; a new family of variants.py gets its own too


def _report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPORT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def _section(text: str, name: str) -> str:
    m = re.search(rf"<!-- report:{name} -->\n(.*?)\n<!-- /report:{name} -->", text, re.S)
    assert m, f"docs/benchmarks.md has no {name} section"
    return m.group(1)


def test_the_files_tables_are_what_the_report_prints():
    p = _report("--print", "files")
    assert p.returncode == 0, p.stderr
    assert p.stdout.rstrip("\n") == _section(DOC.read_text(), "files"), (
        "docs/benchmarks.md is stale: regenerate it with python benchmarks/report.py")


def test_check_catches_a_stale_table(tmp_path):
    stale = tmp_path / "benchmarks.md"
    stale.write_text(DOC.read_text().replace("| standard | standard | tangram |", "| standard | standard | tangrum |"))
    p = _report("--check", "files", "--doc", str(stale))
    assert p.returncode == 1 and "stale in: files" in p.stderr


def test_every_section_and_figure_is_there():
    text = DOC.read_text()
    for name in SECTIONS:
        assert _section(text, name).strip()
    figures = re.findall(r"\]\((benchmarks/[^)]+\.png)\)", text)
    assert len(figures) == 9
    for f in figures:
        data = (ROOT / "docs" / f).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000, f


def test_the_header_names_a_commit_of_this_repository():
    m = re.search(r"from commit ([0-9a-f]{7,40}) ", DOC.read_text())
    assert m, "docs/benchmarks.md does not say which commit it was generated from"
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    assert subprocess.run(["git", "cat-file", "-e", m.group(1) + "^{commit}"], cwd=ROOT).returncode == 0


def test_unknown_section_is_a_usage_error():
    p = _report("--print", "nope")
    assert p.returncode == 2 and "unknown section 'nope'" in p.stderr

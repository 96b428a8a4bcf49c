"""``make test-integrations`` runs every engine suite even when one fails, prints each
suite's result, and fails if any failed. Run against the real Makefile's recipe, with
stand-in suites (an extra makefile defines ``test-<suite>`` targets that pass or fail)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")

STAND_INS = """\
test-first:
\t@echo first ran >> {log}
test-broken:
\t@echo broken ran >> {log}; exit 3
test-last:
\t@echo last ran >> {log}
"""


def run_make(tmp_path: Path, suites: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    log = tmp_path / "ran.log"
    extra = tmp_path / "suites.mk"
    extra.write_text(STAND_INS.format(log=log))
    proc = subprocess.run(["make", "--no-print-directory", "-f", "Makefile", "-f", str(extra), "test-integrations",
                           f"INTEGRATION_SUITES={suites}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    return proc, log.read_text().splitlines() if log.exists() else []


def test_a_failing_suite_does_not_stop_the_others_and_fails_the_run(tmp_path: Path) -> None:
    proc, ran = run_make(tmp_path, "first broken last")
    assert ran == ["first ran", "broken ran", "last ran"]  # every suite ran, in order
    assert proc.returncode != 0
    summary = proc.stdout[proc.stdout.index("== test-integrations:"):].splitlines()
    assert summary == ["== test-integrations:", "  test-first: passed", "  test-broken: FAILED (exit 2)",
                       "  test-last: passed"], proc.stdout
    assert "make test-integrations: failed: broken" in proc.stderr


def test_all_suites_passing_passes(tmp_path: Path) -> None:
    proc, ran = run_make(tmp_path, "first last")
    assert proc.returncode == 0 and ran == ["first ran", "last ran"]
    assert proc.stdout.endswith("== test-integrations:\n  test-first: passed\n  test-last: passed\n"), proc.stdout

"""First contact through the real CLI: `toolkit --version`, short trial runs of shipped
recipes (warnings, not errors), a run's own recipe.json rerunning as it stands, and
overrides that switch between mutually exclusive keys (`key=null`, one of a pair clears the other).
"""
from __future__ import annotations

import json
import platform

import toolkit
from tests.conftest import REPO, run_cli


def test_version_flag_prints_the_version_and_doctor_starts_with_it():
    proc = run_cli("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"toolkit {toolkit.__version__} from {REPO / 'toolkit'} (python {platform.python_version()})\n"
    doctor = run_cli("doctor")
    assert doctor.returncode == 0, doctor.stderr
    assert doctor.stdout.splitlines()[0] == proc.stdout.strip()

"""The attack suite of ``labkit.grade`` (``make test-grade``): a class of submissions, honest and forged, graded as
a teacher grades them, each in its own kernel (about 18 notebook runs), and every chapter with the teacher's answers. It has its own target and its own step in
.ci/run to keep ``make test`` within its time budget, and runs only when asked for (``LABKIT_GRADING_TEST=1``)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/test_grade.py's tiny chapter


def pytest_ignore_collect(collection_path, config):
    if os.environ.get("LABKIT_GRADING_TEST") != "1":
        return True  # only `make test-grade` (LABKIT_GRADING_TEST=1) runs this folder
    return None

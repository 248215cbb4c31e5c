"""The student-version run (``make test-student``): each chapter's student version executed top to bottom.

It executes every chapter once more, as long as ``make test``'s notebook run, so it has its own target (and its own
step in .ci/run) to keep ``make test`` within its time budget. It only runs when asked for
(``LABKIT_STUDENT_TEST=1``, which ``make test-student`` sets).
"""
from __future__ import annotations

import os


def pytest_ignore_collect(collection_path, config):
    if os.environ.get("LABKIT_STUDENT_TEST") != "1":
        return True  # only `make test-student` (LABKIT_STUDENT_TEST=1) runs this folder
    return None

"""Graders for the chapter exercises: ``labkit.checks.<name>(fn)`` grades the learner's ``fn``,
which has the signature of the labkit function of the same name.

A grader tries random shapes, dtypes and edge cases against the reference. It prints one line
on success; on failure it raises :class:`CheckFailed` saying what was tried, what came back,
what was expected, and a hint.
"""
from labkit.checks._core import CheckFailed  # noqa: F401
from labkit.checks.ch00_foundations import *  # noqa: F401,F403
from labkit.checks.ch03_attention import *  # noqa: F401,F403
from labkit.checks.ch07_memory import *  # noqa: F401,F403
from labkit.checks.ch01_precision import *  # noqa: F401,F403
from labkit.checks.ch02_norms import *  # noqa: F401,F403
from labkit.checks.ch04_moe import *  # noqa: F401,F403
from labkit.checks.ch06_quant import *  # noqa: F401,F403
from labkit.checks.ch05_lora import *  # noqa: F401,F403
from labkit.checks.ch08_parallel import *  # noqa: F401,F403
from labkit.checks.ch09_hardware import *  # noqa: F401,F403
from labkit.checks.ch10_preference import *  # noqa: F401,F403

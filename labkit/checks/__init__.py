"""Graders for the chapter exercises: ``labkit.checks.<name>(fn)`` grades the learner's ``fn``,
which has the signature of the labkit function of the same name.

A grader tries random shapes, dtypes and edge cases against the reference. It prints one line
on success; on failure it raises :class:`CheckFailed` saying what was tried, what came back,
what was expected, and a hint.
"""
from labkit.checks._core import CheckFailed, DelegationRefused  # noqa: F401
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
from labkit.checks.ch11_tokenization import *  # noqa: F401,F403
from labkit.checks.ch12_serving import *  # noqa: F401,F403

from labkit.checks import _core as _refusal  # noqa: E402


def _refuse_delegation_in_every_grader() -> None:
    """Every grader refuses, while it runs, labkit's own answer to its exercise (see ``_core.DELEGATES``)."""
    from labkit.checks import (ch00_foundations, ch01_precision, ch02_norms, ch03_attention, ch04_moe, ch05_lora,
                               ch06_quant, ch07_memory, ch08_parallel, ch09_hardware, ch10_preference, ch11_tokenization,
                               ch12_serving)

    for module in (ch00_foundations, ch01_precision, ch02_norms, ch03_attention, ch04_moe, ch05_lora, ch06_quant,
                   ch07_memory, ch08_parallel, ch09_hardware, ch10_preference, ch11_tokenization, ch12_serving):
        for name in module.__all__:
            if name in _refusal.DELEGATES:
                globals()[name] = _refusal.refuse_delegation(getattr(module, name), name)


_refuse_delegation_in_every_grader()

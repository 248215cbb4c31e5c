"""The exception every grader raises for a wrong answer (its own module: the remote-call and refusal code use it
without importing the graders' helpers)."""


class CheckFailed(AssertionError):
    """An exercise answer is wrong; the message says what was tried, got, expected, and a hint."""

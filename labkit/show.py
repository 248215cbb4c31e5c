"""Show labkit's own source in a notebook, so the code a learner runs is the code they read."""
from __future__ import annotations

import inspect


def show_source(obj) -> None:
    """Print the source of a labkit function, class or method (syntax-highlighted in Jupyter)."""
    try:
        source = inspect.getsource(obj)
    except (TypeError, OSError) as err:
        raise TypeError(f"show_source(obj): cannot find the source of {obj!r} ({err})") from None
    try:
        from IPython.display import Markdown, display

        display(Markdown(f"```python\n{source}```"))
    except ImportError:
        print(source)

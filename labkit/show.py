"""Show things in a notebook: labkit's own source (so the code a learner runs is the code they
read) and small tables of results. Imports nothing else from labkit."""
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


def print_table(rows: list[dict]) -> None:
    """Print ``rows`` (dicts with the same keys) as right-aligned columns, floats to 3 significant digits."""
    if not rows:
        return
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in cols}
    print("  ".join(c.rjust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(_fmt(r[c]).rjust(widths[c]) for c in cols))


def _fmt(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)

"""Show things in a notebook: labkit's own source (so the code a learner runs is the code they
read) and small tables of results. Imports nothing else from labkit."""
from __future__ import annotations

import functools
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



def progress_bar(*args, **kwargs):
    """A tqdm progress bar (tqdm's arguments) whose record in a saved notebook is the *finished* bar.

    In Jupyter, tqdm draws a widget whose plain-text form (what a notebook file stores for readers without
    the widget, e.g. on GitHub) is frozen at the first frame, "0/400". This bar is displayed with a display
    id and displayed again into the same output when it closes, so the stored text reads "400/400".
    """
    from tqdm.auto import tqdm

    try:
        from tqdm.notebook import tqdm as notebook_tqdm
    except ImportError:  # no ipywidgets: tqdm.auto is the terminal bar
        notebook_tqdm = None
    if notebook_tqdm is None or not issubclass(tqdm, notebook_tqdm) or kwargs.get("disable"):
        return tqdm(*args, **kwargs)
    return _recorded_bar_class(tqdm)(*args, **kwargs)


@functools.cache
def _recorded_bar_class(notebook_tqdm: type) -> type:
    from IPython.display import display

    class RecordedNotebookBar(notebook_tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, display=False, **kwargs)
            self._record = display(self.container, display_id=True)

        def close(self):
            super().close()
            record, self._record = getattr(self, "_record", None), None
            if record is not None:
                record.update(self.container)

    return RecordedNotebookBar

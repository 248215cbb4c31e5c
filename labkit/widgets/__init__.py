"""The chapters' ipywidgets, one module per chapter. Each widget is a thin UI around a plain
labkit function (its callback), which the unit tests call directly."""

import contextlib
import functools


@contextlib.contextmanager
def figures_drawn_once():
    """Inside, Jupyter shows a matplotlib figure as drawn, without cropping it to its tight bounding box: the crop
    draws the whole figure once more to measure it, twice the time of a widget's redraw (0.45 s against 0.22 s for
    chapter 05's three panels). Figures keep their own margins (``tight_layout`` or ``subplots_adjust``). Outside
    IPython, or where figures are not shown as PNG by the inline backend, nothing changes."""
    try:
        from IPython import get_ipython
        from matplotlib.figure import Figure
    except ImportError:
        yield
        return
    shell = get_ipython()
    formatter = shell.display_formatter.formatters.get("image/png") if shell is not None else None
    try:
        shown = formatter.lookup_by_type(Figure) if formatter is not None else None
    except KeyError:
        shown = None
    if not isinstance(shown, functools.partial) or shown.keywords.get("bbox_inches", "tight") is None:
        yield
        return
    formatter.for_type(Figure, functools.partial(shown.func, *shown.args, **{**shown.keywords, "bbox_inches": None}))
    try:
        yield
    finally:
        formatter.for_type(Figure, shown)


def drawn(callback):
    """``callback`` as an ``ipywidgets.interact`` target. ``interact`` displays whatever its function returns below
    what it drew, so a callback that returns its figure or data (which the tests read) would show it a second time;
    this wrapper draws and returns nothing. The signature is kept (``functools.wraps``), so ``interact`` sees it.
    Its figures are shown as drawn (:func:`figures_drawn_once`): a widget redraws on every change of a control."""

    @functools.wraps(callback)
    def draw(*args, **kwargs) -> None:
        with figures_drawn_once():
            callback(*args, **kwargs)

    return draw

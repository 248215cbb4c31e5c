"""The chapters' ipywidgets, one module per chapter. Each widget is a thin UI around a plain
labkit function (its callback), which the unit tests call directly."""

import functools


def drawn(callback):
    """``callback`` as an ``ipywidgets.interact`` target. ``interact`` displays whatever its function returns below
    what it drew, so a callback that returns its figure or data (which the tests read) would show it a second time;
    this wrapper draws and returns nothing. The signature is kept (``functools.wraps``), so ``interact`` sees it."""

    @functools.wraps(callback)
    def draw(*args, **kwargs) -> None:
        callback(*args, **kwargs)

    return draw

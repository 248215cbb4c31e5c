import pytest

from labkit.data import get_batch
from labkit.show import show_source


def test_show_source_prints_labkit_code(capsys, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "IPython.display", None)  # plain-Python fallback
    show_source(get_batch)
    assert "def get_batch(dataset" in capsys.readouterr().out


def test_show_source_of_a_builtin_is_a_clear_error():
    with pytest.raises(TypeError, match="cannot find the source"):
        show_source(len)


def test_progress_bar_outside_a_notebook_is_tqdms_terminal_bar():
    from tqdm.std import tqdm as terminal_tqdm

    from labkit.show import progress_bar

    bar = progress_bar(range(3), disable=True)
    assert isinstance(bar, terminal_tqdm) and list(bar) == [0, 1, 2]


def test_a_finished_progress_bar_is_what_the_saved_notebook_shows():
    """Run in a real kernel: the notebook file's plain-text record must read 3/3, not the first frame 0/3."""
    import nbformat
    from nbclient import NotebookClient

    from labkit.execute import sliced_waits_client  # a widget's reply can otherwise wait for the time limit (nbclient#312)

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "from labkit.show import progress_bar\nfor _ in progress_bar(range(3), desc='demo'):\n    pass")])
    sliced_waits_client(NotebookClient)(nb, timeout=120, kernel_name="python3").execute()
    texts = [o["data"]["text/plain"] for o in nb.cells[0].outputs if "text/plain" in o.get("data", {})]
    assert len(texts) == 1 and "3/3" in texts[0], texts

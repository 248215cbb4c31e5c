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

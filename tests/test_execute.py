"""labkit.execute: notebooks run top to bottom and written back with their outputs (``make notebooks``)."""
from __future__ import annotations

import nbformat
import pytest

from labkit import execute


def _notebook(path, *sources):
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, path)


def test_outputs_are_written_back_and_the_notebook_runs_in_its_folder(tmp_path):
    (tmp_path / "data.txt").write_text("42")
    path = tmp_path / "nb.ipynb"
    _notebook(path, "value = open('data.txt').read()", "print(value)")
    assert execute.main([str(path)]) == 0
    cells = nbformat.read(path, as_version=4).cells
    assert [c.execution_count for c in cells] == [1, 2]
    assert cells[1].outputs[0]["text"] == "42\n"


def test_output_dir_leaves_the_notebook_as_it_was(tmp_path):
    path, out = tmp_path / "nb.ipynb", tmp_path / "out"
    out.mkdir()
    _notebook(path, "print(6 * 7)")
    before = path.read_text()
    assert execute.main([str(path), "--output-dir", str(out)]) == 0
    assert path.read_text() == before
    assert nbformat.read(out / "nb.ipynb", as_version=4).cells[0].outputs[0]["text"] == "42\n"


def test_an_error_stops_the_run_and_leaves_the_file_as_it_was(tmp_path):
    path = tmp_path / "nb.ipynb"
    _notebook(path, "raise ValueError('boom')")
    before = path.read_text()
    with pytest.raises(Exception, match="boom"):
        execute.execute_in_place(path)
    assert path.read_text() == before

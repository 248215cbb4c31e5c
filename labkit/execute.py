"""Run notebooks top to bottom and store their outputs: ``python -m labkit.execute NOTEBOOK... [--timeout S]
[--output-dir DIR]`` (``make notebooks`` runs it on every chapter, ``tests/claim_spread.py`` under each variant).

It does what ``jupyter nbconvert --to notebook --execute --inplace`` does (nbclient's ``NotebookClient``, the
notebook's own folder as the working directory, outputs and execution counts written back), except that it
waits on the kernel's channels in polls of at most a second: nbclient sometimes misses the wake-up for a reply
that has already arrived when a notebook has widget cells (jupyter/nbclient#312), and nbconvert then sits idle
until the cell's time limit. ``labkit.grade`` runs submissions with the same client.
"""
from __future__ import annotations

import argparse
import inspect
import queue
import time
from pathlib import Path


def sliced_waits(get_msg, step_s: float = 1.0):
    """``get_msg`` of a kernel channel, waiting in polls of at most ``step_s`` seconds.

    nbclient waits for a cell's reply with one long poll of the channel's socket, and with widget cells that poll
    sometimes never wakes although the message has arrived (jupyter/nbclient#312): the run then sits idle until
    the time limit. A new poll sees the waiting message at once, so a missed wake-up costs at most ``step_s``."""

    async def sliced(timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = step_s if deadline is None else max(0.0, min(step_s, deadline - time.monotonic()))
            try:
                message = get_msg(timeout=wait)
                return await message if inspect.isawaitable(message) else message
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    return sliced


def sliced_waits_client(base: type) -> type:
    """nbclient's ``NotebookClient`` (``base``) whose waits on the shell and IOPub channels are sliced."""

    class SlicedWaitsClient(base):
        async def async_start_new_kernel_client(self):
            client = await super().async_start_new_kernel_client()
            for channel in (client.shell_channel, client.iopub_channel):
                channel.get_msg = sliced_waits(channel.get_msg)
            return client

    return SlicedWaitsClient


def read_notebook(source) -> dict:
    """A notebook (a path, or its text) as nbformat reads it, upgraded to nbformat 4: sources as strings whether
    the file stores them as strings or as lists of lines (Jupyter's own way), any 4.x minor version, cell ids
    or none. Raises ValueError saying why it is not a notebook."""
    import nbformat

    text = Path(source).read_text(encoding="utf-8") if isinstance(source, Path) else source
    try:
        notebook = nbformat.reads(text, as_version=4)
    except Exception as err:  # nbformat raises NotJSONError, ValidationError, KeyError, ... for what it cannot read
        raise ValueError(f"not a notebook ({type(err).__name__}: {str(err)[:200]})") from None
    if not isinstance(notebook.get("cells"), list):
        raise ValueError("not a notebook (no nbformat-4 'cells')")
    for cell in notebook["cells"]:
        if not isinstance(cell, dict) or cell.get("cell_type") not in ("code", "markdown", "raw"):
            raise ValueError("not a notebook (a cell without a valid cell_type)")
        if isinstance(cell.get("source"), list):  # nbformat joins them; a hand-made dict may not have been
            cell["source"] = "".join(cell["source"])
    return notebook


def execute_in_place(path: Path, timeout: float = 300, output: Path | None = None) -> None:
    """Run the notebook at ``path`` top to bottom in a fresh kernel (its own folder as the working directory,
    ``timeout`` seconds per cell) and write it with its outputs back to ``path`` (or to ``output``); a cell's
    error stops the run and writes nothing."""
    import nbformat
    from nbclient import NotebookClient

    path = Path(path)
    notebook = read_notebook(path)
    sliced_waits_client(NotebookClient)(notebook, timeout=timeout, resources={"metadata": {"path": str(path.parent)}}).execute()
    nbformat.write(notebook, output or path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit.execute", description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path, help="notebooks to run; each is written back with its outputs")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per cell (default: 300)")
    parser.add_argument("--output-dir", type=Path, help="write the executed notebooks here instead of in place")
    args = parser.parse_args(argv)
    for path in args.notebooks:
        started = time.monotonic()
        execute_in_place(path, args.timeout, args.output_dir / path.name if args.output_dir else None)
        print(f"{path}: ran in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

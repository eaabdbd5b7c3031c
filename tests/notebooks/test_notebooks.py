"""The teaching notebooks in notebooks/ run top to bottom on CPU and are stored without outputs.

Each notebook is executed by nbclient in a fresh kernel whose working directory is notebooks/ and whose
Python is this interpreter (so it sees the same jvllm install, embedded models and JVLLM_CACHE_DIR).
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import sys
import time

import nbformat
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS_DIR = REPO / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
EXPECTED = {"quickstart", "serving_and_metrics", "throughput", "embeddings", "multimodal"}
CELL_TIMEOUT_S = 300  # per cell; the slowest (throughput's sweeps) take a minute or two on a busy 2-core CPU
KERNEL_NAME = "jvllm-notebook-test"


def test_the_notebooks_are_all_there():
    assert EXPECTED <= {path.stem for path in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=nbformat.NO_CONVERT)
    assert nb.nbformat == 4
    nbformat.validate(nb)
    assert nb.cells and nb.cells[0].cell_type == "markdown", "a notebook starts with its introduction"
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"cell {index} has stored outputs"
            assert cell.execution_count is None, f"cell {index} has an execution count"
    assert "widgets" not in nb.metadata, "saved widget state: clear the outputs before committing"


def test_readme_links_every_notebook():
    readme = (REPO / "README.md").read_text()
    for path in NOTEBOOKS:
        assert f"(notebooks/{path.name})" in readme, f"README.md does not link {path.name}"


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory):
    """A kernelspec for this very interpreter, found first on JUPYTER_PATH, so that a user-level
    `python3` kernelspec pointing at another Python cannot be picked up instead."""
    root = tmp_path_factory.mktemp("jupyter")
    spec_dir = root / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "jvllm tests", "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JUPYTER_PATH", os.pathsep.join(filter(None, [str(root), os.environ.get("JUPYTER_PATH")])))
        patch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")  # headless, as in Jupyter
        yield KERNEL_NAME


def _execute(nb: nbformat.NotebookNode, kernel_name: str) -> None:
    """Run every cell in place (outputs land in `nb`, also when a cell fails and this raises)."""
    from nbclient import NotebookClient

    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name=kernel_name,
                            resources={"metadata": {"path": str(NOTEBOOKS_DIR)}})
    client.execute()  # raises CellExecutionError (with the cell's traceback) if any cell fails


def _tagged(nb: nbformat.NotebookNode, tag: str) -> nbformat.NotebookNode:
    cells = [cell for cell in nb.cells if tag in cell.metadata.get("tags", [])]
    assert len(cells) == 1, f"expected one cell tagged {tag!r}, found {len(cells)}"
    return cells[0]


def _stdout(cell: nbformat.NotebookNode) -> str:
    return "".join(o.text for o in cell.get("outputs", []) if o.output_type == "stream" and o.name == "stdout")


def _data(cell: nbformat.NotebookNode, mime: str) -> list[str]:
    return [o.data[mime] for o in cell.outputs if o.output_type in ("display_data", "execute_result")
            and mime in o.data]


def _check_quickstart(nb: nbformat.NotebookNode) -> None:
    completions = re.findall(r"^  -> (.*)$", _stdout(_tagged(nb, "generate-batch")), re.MULTILINE)
    assert len(completions) == 4 and all(text not in ("''", '""') for text in completions), completions
    chat = _stdout(_tagged(nb, "chat"))
    assert chat.count("assistant: ") == 2 and "assistant: \n" not in chat, chat
    streamed = _stdout(_tagged(nb, "stream"))
    text, _, summary = streamed.rpartition("\n\n[")
    assert text.strip() and "finish_reason=" in summary, streamed
    table = _tagged(nb, "sampling-table")
    assert any("<table" in html for html in _data(table, "text/html"))
    assert "same seed, same text: True" in _stdout(table)


def _check_serving_and_metrics(nb: nbformat.NotebookNode) -> None:
    assert re.search(r"^assistant: \S", _stdout(_tagged(nb, "chat")), re.MULTILINE)
    assert re.search(r"\[\d+ chunks, [1-9]\d* completion tokens\]", _stdout(_tagged(nb, "stream")))
    metrics = _stdout(_tagged(nb, "metrics"))
    assert re.search(r"jvllm:generation_tokens_total\s+[1-9]", metrics), metrics
    assert "server exit code: 0" in _stdout(_tagged(nb, "server-stop"))


def _assert_server_stopped(nb: nbformat.NotebookNode) -> None:
    """Whatever happened in the notebook, the server process it started (it prints the pid) must be gone."""
    found = re.search(r"server pid (\d+)", _stdout(_tagged(nb, "server-start")))
    if found is None:
        return  # the server was never started
    pid = int(found.group(1))
    deadline = time.monotonic() + 30  # after a failed cell, the kernel's atexit hook may still be draining it
    while _alive(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"the notebook left its server (pid {pid}) running")
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (one its new parent has not reaped yet counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:  # no /proc here, or it just went away (the next look settles it)
        return True


def _check_throughput(nb: nbformat.NotebookNode) -> None:
    for tag in ("jvllm", "transformers"):
        rows = re.findall(r"batch\s+(\d+):\s+([\d.]+) tok/s", _stdout(_tagged(nb, tag)))
        assert [int(b) for b, _ in rows] == [1, 4, 16] and all(float(v) > 0 for _, v in rows), rows
    assert _data(_tagged(nb, "plot"), "image/png"), "the plot cell drew no image"


def _check_embeddings(nb: nbformat.NotebookNode) -> None:
    assert "embeddings: (8, 384)" in _stdout(_tagged(nb, "embed"))
    assert _data(_tagged(nb, "heatmap"), "image/png"), "the heatmap cell drew no image"
    search = _stdout(_tagged(nb, "search"))
    best = re.search(r"^\s+([\d.]+)\s+(.*)$", search, re.MULTILINE)
    assert best and "bread" in best.group(2), search


def _check_multimodal(nb: nbformat.NotebookNode) -> None:
    assert _data(_tagged(nb, "image"), "image/png"), "the drawing cell showed no image"
    generated = _stdout(_tagged(nb, "generate"))
    assert re.search(r"^\d+ prompt tokens, 576 of them the image's$", generated, re.MULTILINE), generated
    assert re.search(r"^-> '.+'$", generated, re.MULTILINE), generated
    assert re.search(r"^assistant: '.+'$", _stdout(_tagged(nb, "chat")), re.MULTILINE)
    ttft = _stdout(_tagged(nb, "ttft"))
    assert "in these 6 requests: 3 hits of 6 lookups" in ttft, ttft  # each repeat a hit, each new image a miss
    assert re.search(r"^assistant: '.+'$", _stdout(_tagged(nb, "server-chat")), re.MULTILINE)
    assert re.search(r"^400: could not decode the image", _stdout(_tagged(nb, "server-error")), re.MULTILINE)
    assert "server exit code: 0" in _stdout(_tagged(nb, "server-stop"))
    qwen = _stdout(_tagged(nb, "qwen"))  # the smaller copy takes fewer tokens: 6 x 9 and 13 x 17 token grids
    assert "image tokens: [54, 221] token grids (rows, columns): [(6, 9), (13, 17)]" in qwen, qwen
    assert re.search(r"^-> '.+'$", qwen, re.MULTILINE), qwen


CHECKS = {"quickstart": _check_quickstart, "serving_and_metrics": _check_serving_and_metrics,
          "throughput": _check_throughput, "embeddings": _check_embeddings, "multimodal": _check_multimodal}
CLEANUPS = {"serving_and_metrics": _assert_server_stopped, "multimodal": _assert_server_stopped}


# The notebooks whose features other tests cover on the same engine (embeddings, images, throughput settings)
EXTENDED_NOTEBOOKS = {"embeddings", "multimodal", "serving_and_metrics", "throughput"}


@pytest.mark.slow
@pytest.mark.parametrize("path", [pytest.param(path, marks=pytest.mark.extended) if path.stem in EXTENDED_NOTEBOOKS
                                  else path for path in NOTEBOOKS], ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, kernel_name):
    nb = nbformat.read(path, as_version=4)
    try:
        _execute(nb, kernel_name)
    finally:
        if path.stem in CLEANUPS:
            CLEANUPS[path.stem](nb)
    errors = [o for cell in nb.cells for o in cell.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
    CHECKS.get(path.stem, lambda nb: None)(nb)

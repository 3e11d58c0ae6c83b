"""Every notebook in notebooks/ runs top to bottom without a cell error, in a kernel on this
interpreter, and is stored without outputs (in the working tree and in git's index)."""

import json
import os
import subprocess
import sys

import nbclient
import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK_DIR = os.path.join(ROOT, "notebooks")
NOTEBOOKS = sorted(f for f in os.listdir(NOTEBOOK_DIR) if f.endswith(".ipynb")) if os.path.isdir(NOTEBOOK_DIR) else []
KERNEL = "mixserve-test-python"


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory):
    """A kernelspec pinned to this interpreter (sys.executable), found through JUPYTER_PATH, so the
    notebook never runs in some other python that happens to own the name "python3"."""
    data = tmp_path_factory.mktemp("jupyter")
    spec = data / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "mixserve tests", "language": "python",
    }))
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = str(data) + (os.pathsep + old if old else "")
    yield KERNEL
    if old is None:
        del os.environ["JUPYTER_PATH"]
    else:
        os.environ["JUPYTER_PATH"] = old


def test_there_are_notebooks():
    assert "01_quickstart.ipynb" in NOTEBOOKS


def assert_stripped(nb, where):
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{where}: cell {i} has stored outputs"
            assert cell.execution_count is None, f"{where}: cell {i} has an execution_count"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_stored_without_outputs(name):
    path = os.path.join(NOTEBOOK_DIR, name)
    assert_stripped(nbformat.read(path, as_version=4), path)
    # the version git would commit (the index); skipped only when the file is not tracked yet
    staged = subprocess.run(["git", "show", f":notebooks/{name}"], cwd=ROOT, capture_output=True, text=True)
    if staged.returncode == 0:
        assert_stripped(nbformat.reads(staged.stdout, as_version=4), f"git index: notebooks/{name}")


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_runs_without_errors(name, kernel_name):
    nb = nbformat.read(os.path.join(NOTEBOOK_DIR, name), as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    client = nbclient.NotebookClient(nb, kernel_name=kernel_name, timeout=300,
                                     resources={"metadata": {"path": NOTEBOOK_DIR}})
    client.execute()  # raises CellExecutionError on the first failing cell
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    assert nb.cells[-1].outputs[0]["text"].strip() == sys.executable

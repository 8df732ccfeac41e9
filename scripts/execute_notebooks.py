"""Executes notebooks headless (nbclient) and stores them in place with their outputs and plots.

    python scripts/execute_notebooks.py                              # every notebooks/*.ipynb
    python scripts/execute_notebooks.py notebooks/quickstart.ipynb   # only these

Each runs in its own kernel (`python3`, the one of the python running this script), with notebooks/ as
its working directory, a fresh TMPDIR (the workdirs and task suites it creates; removed afterwards)
and `LONGHORIZON_NOTEBOOK_SMOKE` as set in the environment (default "1": the smoke settings the
committed outputs and CI use). A notebook that raises is not written back; the script goes on with
the next one and exits non-zero. It prints each notebook's wall time and the size of its outputs.
`tests/test_notebooks.py` checks that the stored notebooks are executed.
"""

import json
import os
import pathlib
import sys
import tempfile
import time

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
CELL_TIMEOUT_S = 1200


def execute(path: pathlib.Path) -> bool:
  """Executes `path` and writes it back with its outputs; returns whether it ran without an error."""
  notebook = nbformat.read(path, as_version=4)
  for cell in notebook.cells:  # nothing from an earlier run survives a cell that is not reached
    if cell.cell_type == "code":
      cell.outputs, cell.execution_count = [], None
  started = time.perf_counter()
  try:
    with tempfile.TemporaryDirectory(prefix="notebook_") as tmp:
      os.environ["TMPDIR"] = tmp  # inherited by the kernel
      # record_timing=False: no per-cell timestamps in the stored metadata, so reruns diff cleanly.
      NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3", record_timing=False,
                     resources={"metadata": {"path": str(path.parent)}}).execute()
  except CellExecutionError as error:
    print(f"{path.name}: failed after {time.perf_counter() - started:.0f} s, not written\n{error}")
    return False
  seconds = time.perf_counter() - started
  nbformat.write(notebook, path)
  outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
  size = len(json.dumps(outputs))
  print(f"{path.name}: {seconds:.0f} s, {len(outputs)} outputs, {size / 1e6:.2f} MB of outputs, "
        f"{path.stat().st_size / 1e6:.2f} MB on disk")
  return True


def main(argv: list[str]) -> int:
  if any(arg.startswith("-") for arg in argv):
    print(__doc__)
    return 2
  paths = [pathlib.Path(arg).resolve() for arg in argv] or sorted(NOTEBOOKS.glob("*.ipynb"))
  missing = [str(p) for p in paths if not p.is_file()]
  if missing:
    print(f"no such notebook: {missing}; pass paths like notebooks/quickstart.ipynb")
    return 2
  os.environ.setdefault("LONGHORIZON_NOTEBOOK_SMOKE", "1")
  print("LONGHORIZON_NOTEBOOK_SMOKE =", os.environ["LONGHORIZON_NOTEBOOK_SMOKE"])
  failed = [p.name for p in paths if not execute(p)]
  if failed:
    print("failed:", failed)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

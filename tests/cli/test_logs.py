"""longhorizon.cli.logs.setup, in fresh absl processes as the entry points run it: every record
printed once; orbax's and tensorflow_datasets' records dropped; after a failed orbax restore the real
error ends the output, with no `Event loop is closed` tracebacks."""

import logging
import os
import pathlib
import subprocess
import sys

from longhorizon.cli import logs

ROOT = pathlib.Path(__file__).parents[2]

_ONCE = r'''
import logging
from absl import app
from longhorizon.cli import logs


def main(argv):
  logs.setup()
  # huggingface_hub gives its library logger a stderr handler on import and leaves it propagating.
  hub = logging.getLogger("huggingface_hub")
  hub.addHandler(logging.StreamHandler())
  hub.setLevel(logging.WARNING)
  logging.getLogger("longhorizon.train.metrics").warning("metrics-warning")
  logging.getLogger("huggingface_hub.file_download").warning("hub-warning")
  for name, level, text in [("orbax", logging.INFO, "orbax-info"),
                            ("orbax", logging.ERROR, "orbax-error"),
                            ("tensorflow_datasets", logging.WARNING, "tfds-warning")]:
    logger = logging.getLogger(name)
    logger.handle(logger.makeRecord(name, level, f"/site-packages/{name}/core/x.py", 1, text, (),
                                    None))
  logs.setup()  # a second call adds nothing
  logging.getLogger("longhorizon.train.checkpoints").warning("checkpoints-warning")


app.run(main)
'''

_RESTORE = r'''
import asyncio
import logging
import pathlib

from absl import app
import numpy as np

from longhorizon.cli import logs
from longhorizon.train.checkpoints import Checkpointer


class _CallsIntoAClosedLoop:
  # What a pending tensorstore callback does once orbax has closed its event loop: it raises
  # `RuntimeError: Event loop is closed` where nothing can catch it (an unraisable exception).
  # Real failures produce dozens of these, but how many depends on timing; this one always fires.
  def __init__(self):
    self.loop = asyncio.new_event_loop()
    self.loop.close()

  def __del__(self):
    self.loop.call_soon_threadsafe(lambda: None)


class _RaisesOnDelete:
  def __del__(self):
    raise ValueError("an unrelated unraisable error")


async def _abandoned():
  pass


def main(argv):
  logs.setup()
  directory = pathlib.Path(argv[1])
  with Checkpointer(directory) as checkpointer:
    checkpointer.save(1, {f"w{i}": np.full((128, 128), i, np.float32) for i in range(30)},
                      {"update": 1}, force=True)
  (directory / "1" / "state" / "manifest.ocdbt").write_bytes(b"damaged")
  _CallsIntoAClosedLoop()
  logging.getLogger("asyncio").error("Exception in callback", exc_info=RuntimeError(
      "Event loop is closed"))
  _abandoned()  # a coroutine never awaited, as orbax leaves them after a failure
  _RaisesOnDelete()  # an unraisable error that is not orbax's noise
  Checkpointer(directory).restore(1)


app.run(main)
'''


def _run_script(tmp_path, source, *args):
  script = tmp_path / "script.py"
  script.write_text(source)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                        timeout=300, cwd=ROOT, env=env)


def test_every_record_is_printed_once(tmp_path):
  result = _run_script(tmp_path, _ONCE)
  assert result.returncode == 0, result.stderr[-3000:]
  err = result.stderr
  for text in ("metrics-warning", "hub-warning", "checkpoints-warning"):
    assert err.count(text) == 1, (text, err)
  assert not any(text in err for text in ("orbax-info", "orbax-error", "tfds-warning"))


def test_a_failed_orbax_restore_ends_with_its_error_not_event_loop_noise(tmp_path):
  result = _run_script(tmp_path, _RESTORE, str(tmp_path / "checkpoints"))
  assert result.returncode != 0
  err = result.stderr
  assert "Event loop is closed" not in err, err[-3000:]
  assert "an unrelated unraisable error" in err  # other unraisable errors still reach the hook
  last_lines = err.strip().splitlines()[-3:]
  assert last_lines[-1] == f"while restoring checkpoint step 1 from {tmp_path / 'checkpoints'}", (
      err[-5000:])
  assert any("DATA_LOSS" in line for line in last_lines), last_lines
  assert "was never awaited" not in err


def _failure_raised_in(filename):
  namespace = {}
  exec(compile("def read():\n  raise ValueError('DATA_LOSS: damaged')\n", filename, "exec"), namespace)
  try:
    namespace["read"]()
  except ValueError as e:
    return e


def _asyncio_record(message, exc):
  return logging.getLogger("asyncio").makeRecord(
      "asyncio", logging.ERROR, "/usr/lib/python3.11/asyncio/base_events.py", 1, message, (),
      (type(exc), exc, exc.__traceback__))


def test_never_retrieved_copies_of_an_orbax_failure_are_dropped_and_others_kept():
  console = logs.ConsoleFilter()
  in_orbax = _failure_raised_in("/site-packages/orbax/checkpoint/_src/serialization/x.py")
  in_tensorstore = _failure_raised_in("/site-packages/tensorstore/x.py")
  elsewhere = _failure_raised_in("/work/my_env/step.py")
  never = "Future exception was never retrieved\nfuture: <Future finished exception=...>"
  assert not console.filter(_asyncio_record(never, in_orbax))
  assert not console.filter(_asyncio_record(never, in_tensorstore))
  assert console.filter(_asyncio_record(never, elsewhere))  # a user's own lost exception is shown
  assert console.filter(_asyncio_record("Exception in callback", in_orbax))  # only that message
  # tensorstore's C++ sets its error on the future: no Python traceback, only its spec to tell it.
  from_cxx = ValueError('DATA_LOSS: Error opening "zarr" driver [tensorstore_spec=\'{"driver": '
                        '"zarr"}\']')
  assert from_cxx.__traceback__ is None
  assert not console.filter(_asyncio_record(never, from_cxx))
  assert console.filter(_asyncio_record(never, ValueError("DATA_LOSS: my own store")))

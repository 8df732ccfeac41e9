"""Console logging of the entry points: every record printed once, the real error of a failure last.

    def main(argv):
      logs.setup()   # first thing in an absl `main` (experiments/train.py, experiments/evaluate.py)
      ...

All records go through absl's handler (which `app.run` puts on the root logger), which `setup`
filters:
- **Printed once.** A record whose logger, or one of its ancestors below the root, has its own
  handler (huggingface_hub's stderr handler, jax's with `JAX_LOGGING_LEVEL`) was printed by that
  handler already; absl's skips it instead of printing it a second time.
- **Quiet libraries.** Every record of orbax and tensorflow_datasets is dropped. orbax logs every
  save step at INFO, and when a save fails it logs the error from each of its threads, then, once
  its signalling threads time out (5 minutes later), a `TimeoutError` from each: that would bury
  the error, which orbax raises to `Checkpointer`'s caller anyway (train.py reports it).
  tensorflow_datasets logs every shard, and a warning about the task suites' builder configs on
  every load (`longhorizon.envs.tasks` raises `CorruptSuiteError` naming a damaged suite's file).
- **No asyncio shutdown noise.** When an orbax save or restore fails, tensorstore callbacks still
  pending on orbax's event loops fire after the loop was closed; each one raises `RuntimeError:
  Event loop is closed` as an "unraisable" exception (dozens of tracebacks), and the coroutines
  orbax abandoned print `RuntimeWarning: coroutine ... was never awaited` at exit; and, depending
  on timing, asyncio logs `Future exception was never retrieved` with a copy of the failure for
  each of orbax's other failed reads, after the failure's own traceback. All are dropped
  (`sys.unraisablehook`, a warnings filter, and the handler filter for asyncio's logged forms; a
  never-retrieved exception is dropped only when it is tensorstore's: its traceback passes through
  orbax or tensorstore, or, as for an error tensorstore's C++ sets on a future (which has no
  Python traceback), its message carries tensorstore's `tensorstore_spec=`), so the failure's own
  traceback or message is what ends the output. Other unraisable exceptions, and other
  never-retrieved ones, are printed unchanged.
"""

from __future__ import annotations

import logging
import sys
import warnings

from absl import logging as absl_logging

__all__ = ["setup", "ConsoleFilter"]

# Libraries whose records would drown the run's own messages (see the module docstring).
_SILENT = ("/orbax/", "/tensorflow_datasets/")
_CLOSED_LOOP = "Event loop is closed"
_NEVER_RETRIEVED = "exception was never retrieved"
_NOISY_FRAMES = ("/orbax/", "/tensorstore/")
# tensorstore's errors end with the spec of the store they failed on; those set on a future from
# C++ carry no Python traceback, so this is how they are recognised.
_TENSORSTORE_ERROR = "tensorstore_spec="


def _is_closed_loop_error(exc: BaseException | None) -> bool:
  return isinstance(exc, RuntimeError) and str(exc) == _CLOSED_LOOP


def _raised_in_orbax(exc: BaseException | None) -> bool:
  if exc is None:
    return False
  if _TENSORSTORE_ERROR in str(exc):
    return True
  tb = exc.__traceback__
  while tb is not None:
    if any(part in tb.tb_frame.f_code.co_filename for part in _NOISY_FRAMES):
      return True
    tb = tb.tb_next
  return False


def _printed_by_own_handler(record: logging.LogRecord) -> bool:
  """True if the record's logger or an ancestor below the root has a handler that printed it."""
  logger = logging.getLogger(record.name)
  while logger is not None and logger is not logging.root:
    if any(record.levelno >= h.level for h in logger.handlers):
      return True
    if not logger.propagate:
      return False
    logger = logger.parent
  return False


class ConsoleFilter(logging.Filter):
  """The filter `setup` puts on absl's handler (see the module docstring)."""

  def filter(self, record: logging.LogRecord) -> bool:
    if any(part in record.pathname for part in _SILENT):
      return False
    if record.exc_info and _is_closed_loop_error(record.exc_info[1]):
      return False
    if record.name == "asyncio" and _CLOSED_LOOP in record.getMessage():
      return False
    if (record.name == "asyncio" and _NEVER_RETRIEVED in record.getMessage() and record.exc_info
        and _raised_in_orbax(record.exc_info[1])):
      return False
    return not _printed_by_own_handler(record)


def _drop_closed_loop_unraisables(previous):
  def hook(unraisable):
    if not _is_closed_loop_error(unraisable.exc_value):
      previous(unraisable)
  hook.drops_closed_loop_noise = True
  return hook


def setup(verbosity: int = absl_logging.INFO):
  """Sets absl's verbosity and installs the filters of the module docstring; idempotent.

  Call it at the start of an absl `main` (after `app.run` has put absl's handler on the root).
  """
  absl_logging.set_verbosity(verbosity)
  absl_logging.use_absl_handler()  # app.run did it already; a no-op then
  handler = absl_logging.get_absl_handler()
  if not any(isinstance(f, ConsoleFilter) for f in handler.filters):
    handler.addFilter(ConsoleFilter())
  if not getattr(sys.unraisablehook, "drops_closed_loop_noise", False):
    sys.unraisablehook = _drop_closed_loop_unraisables(sys.unraisablehook)
  # The coroutines orbax abandons after a failure; this package itself has none.
  warnings.filterwarnings("ignore", message=r"coroutine '.*' was never awaited",
                          category=RuntimeWarning)

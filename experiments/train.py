r"""Trains a policy: SFT warm start, then RL, then evaluation (see `longhorizon.train.loop`).

    python experiments/train.py --config=configs/default.py --workdir=/tmp/lh_default \
        [--config.num_updates=40] [--config.algorithm.name=gigpo] ...

Rerunning with the same --workdir resumes from the last checkpoint (the newest one that restores;
a damaged one is set aside), with the same config: changes to fields that are fixed for a run are
refused with the diff. `--init_from=OTHER_WORKDIR` starts a new run from another run's checkpoint
(its newest, or `--init_from_step=N`).
The config is validated before anything is built: a wrong value names the field and the allowed
values. A workdir is used by one run at a time (a lock file names the owner).
"""

import os
import sys
import traceback

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from longhorizon.cli import logs
from longhorizon.envs import tasks as task_suites
from longhorizon.train import config as config_lib
from longhorizon.train import loop
from longhorizon.train import workdir as workdir_lib
from longhorizon.train.checkpoints import CheckpointError

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and results "
                                "(relative paths and ~ work; one run at a time: it is locked).")
_INIT_FROM = flags.DEFINE_string(
    "init_from", None, "Start a new run from another run's workdir: its newest checkpoint's policy "
    "parameters, with this config's algorithm and optimiser (e.g. several algorithms from one warm "
    "start). Recorded in init_from.json and eval.json.")
_INIT_FROM_STEP = flags.DEFINE_integer(
    "init_from_step", None, "With --init_from: the source's checkpoint step to start from "
    "(default: its newest restorable one); a missing step is an error naming the steps there.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "Multi-host: host:port of process 0 (or JAX_COORDINATOR_ADDRESS).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-host: this process's index.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Multi-host: always call jax.distributed.initialize() (Cloud TPU pods "
    "find their coordinator from the metadata server; experiments/launch_tpu_pod.sh sets this).")
flags.mark_flags_as_required(["config", "workdir"])


def maybe_initialize_distributed():
  """Calls `jax.distributed.initialize` for multi-host runs: with explicit flags, with the standard
  environment variables (JAX_COORDINATOR_ADDRESS, ...), or on a Cloud TPU pod (auto-detected)."""
  explicit = (_DISTRIBUTED.value or _COORDINATOR.value or _NUM_PROCESSES.value
              or _PROCESS_ID.value is not None)
  from_env = "JAX_COORDINATOR_ADDRESS" in os.environ or "TPU_WORKER_HOSTNAMES" in os.environ
  if not (explicit or from_env):
    return
  kwargs = {}
  if _COORDINATOR.value:
    kwargs["coordinator_address"] = _COORDINATOR.value
  if _NUM_PROCESSES.value:
    kwargs["num_processes"] = _NUM_PROCESSES.value
  if _PROCESS_ID.value is not None:
    kwargs["process_id"] = _PROCESS_ID.value
  jax.distributed.initialize(**kwargs)


def crash_hook():
  """`LONGHORIZON_CRASH_AT=POINT:UPDATE` (POINT in rollout, update, checkpoint) kills the process
  with SIGKILL-like abruptness at that point of that (0-based) update: for kill-and-resume tests."""
  spec = os.environ.get("LONGHORIZON_CRASH_AT", "")
  if not spec:
    return None
  point, _, update = spec.partition(":")
  if point not in ("rollout", "update", "checkpoint") or not update.isdigit():
    raise app.UsageError(f"LONGHORIZON_CRASH_AT={spec!r}: expected POINT:UPDATE with POINT in "
                         "rollout, update, checkpoint.")

  def hook(where, at):
    if where == point and at == int(update):
      os._exit(137)
  return hook


def _exit_now(code: int):
  """Flushes the output and ends the process without waiting for non-daemon threads."""
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logs.setup()  # absl at INFO; each record once; orbax INFO and asyncio noise dropped
  maybe_initialize_distributed()
  logging.info("JAX devices: %s (process %d of %d)", jax.devices(), jax.process_index(),
               jax.process_count())
  try:
    config_lib.validate(_CONFIG.value)
    result = loop.train_and_evaluate(_CONFIG.value, _WORKDIR.value, hook=crash_hook(),
                                     init_from=_INIT_FROM.value,
                                     init_from_step=_INIT_FROM_STEP.value)
  except (config_lib.ConfigError, workdir_lib.WorkdirError, CheckpointError,
          task_suites.CorruptSuiteError) as e:
    # A config field or a workdir the user can fix: the message names it; no traceback.
    logging.error("%s", e)
    _exit_now(2)
  except OSError as e:
    # The machine refused (a full disk, a read-only or vanished folder): the message names the
    # path; the checkpoints and metrics written before are intact.
    logging.error("training failed: %s: %s; fix it and rerun the same command to resume from the "
                  "last checkpoint.", type(e).__name__, e)
    _exit_now(1)
  except BaseException as e:  # pylint: disable=broad-except
    # Any other failure (a save that cannot write, Ctrl-C, a bug): report it and exit at once.
    # Orbax's background threads (its barrier client waits 300 s) would otherwise keep the
    # process alive for minutes after the error is printed. Nothing is lost by not waiting: the
    # committed checkpoints and the metrics lines are on disk, the lock dies with the process.
    if isinstance(e, KeyboardInterrupt):
      logging.error("interrupted; rerun the same command to resume from the last checkpoint.")
      _exit_now(130)
    traceback.print_exc()
    logging.error("training failed (%s: %s); rerun the same command to resume from the last "
                  "checkpoint once the cause is fixed.", type(e).__name__, e)
    _exit_now(1)
  print("final:", {k: result[k] for k in ("success_rate", "warm_start_success_rate",
                                          "greedy_success_rate")})


if __name__ == "__main__":
  app.run(main)

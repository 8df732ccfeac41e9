r"""The oracle's episodes in each context mode of a host-environment config: does it finish, in
how many tokens.

    python experiments/oracle_context_lengths.py --config=configs/context_modes_textworld.py

Plays `--games` test tasks of the config's environment with the oracle (no noise) in `full` with
an unbounded context (the tokens a whole episode needs), then in every mode at the config's
`rollout.context_length` with its `context.*` settings (`offload` wraps the environment in its
notebook), and prints one line per mode: success per game, termination codes (1 terminated,
4 context overflow) and the tokens of the last context row. A mode where the oracle overflows
cannot be finished by any policy at that budget.
"""

import dataclasses

from absl import app
from absl import flags
import jax
from ml_collections import config_flags
import numpy as np

from longhorizon import envs, rollout
from longhorizon.train.learner import make_env
from longhorizon.train.options import ContextOptions, RolloutOptions

_CONFIG = config_flags.DEFINE_config_file("config", None, "A training config.", lock_config=True)
_GAMES = flags.DEFINE_integer("games", 3, "Test tasks played.", lower_bound=1)
flags.mark_flags_as_required(["config"])


def main(argv):
  del argv
  base = _CONFIG.value
  opts = RolloutOptions.from_config(base)
  runs = [("full (unbounded)", "full", 1 << 14)] + [
      (mode, mode, opts.context_length) for mode in ("full", "window", "summary", "offload")]
  tasks = keys = None
  for name, mode, length in runs:
    c = base.copy_and_resolve_references()
    c.unlock()
    c.context.mode = mode
    env = make_env(c)
    if not envs.is_host(env):
      raise app.UsageError(f"--config: {c.env.name!r} is a JAX environment; this plays host "
                           "environments (the JAX ones' overflow is tested in "
                           "tests/train/test_context_modes.py).")
    if tasks is None:
      tasks = env.tasks("test", _GAMES.value, c.tasks.seed)
      keys = jax.random.split(jax.random.key(0), _GAMES.value)
    codec = env.codec()
    rc = dataclasses.replace(opts, context_length=length).collect_config(
        c.env.max_steps, context=ContextOptions.from_config(c), group_size=1)
    batch, _ = rollout.collect(None, None, env, codec, tasks, keys, rc, sampling_seed=0,
                               scripted=rollout.oracle_turns(env, codec))
    used = np.asarray(batch.attention_mask).sum(-1)
    print(f"{name:>17} at {length:>5} tokens: success {np.asarray(batch.success).astype(int)}, "
          f"termination {np.asarray(batch.termination)}, last row's tokens {used}")


if __name__ == "__main__":
  app.run(main)

"""Prints the newest episodes of a trajectory store, turn by turn with their masks.

    python -m longhorizon.cli.store runs/run1                    # a workdir: runs/run1/trajectories
    python -m longhorizon.cli.store runs/run1 --last 3 --filter env_error,truncated --markup plain
    python -m longhorizon.cli.store /data/store --config configs/default.py:smoke

Each episode is rendered by `rollout.render_episode` (sampled tokens, the ones with `loss_mask` 1,
marked: green with `--markup ansi`, «» with `plain`), under a line naming its update, file, row,
versions and key. The tokenizer and milestone names are rebuilt from the run's config: the
workdir's `config.json` (a store at `<workdir>/trajectories` finds it too), or `--config` (a config
file `path.py[:variant]` or a saved `config.json`). A run whose `model.checkpoint` is set loads that
checkpoint for its tokenizer.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import ml_collections

from longhorizon.rollout import render
from longhorizon.rollout import store as store_lib
from longhorizon.models import checkpoint as checkpoint_lib
from longhorizon.train.learner import make_env
from longhorizon.train.loop import STORE_DIR

__all__ = ["main", "load_config", "locate"]


def locate(path: str) -> tuple[str, str | None]:
  """`(store directory, the run's config.json or None)` for a workdir or a store directory."""
  if os.path.exists(os.path.join(path, "config.json")):
    return os.path.join(path, STORE_DIR), os.path.join(path, "config.json")
  parent = os.path.join(os.path.dirname(os.path.abspath(path)), "config.json")
  return path, parent if os.path.exists(parent) else None


def load_config(spec: str) -> ml_collections.ConfigDict:
  """A config from a saved `config.json` or a config file `path.py[:variant]` (its get_config)."""
  if spec.endswith(".json"):
    with open(spec, encoding="utf-8") as f:
      return ml_collections.ConfigDict(json.load(f))
  path, _, variant = spec.partition(":")
  module_spec = importlib.util.spec_from_file_location("store_cli_config", path)
  if module_spec is None or not os.path.exists(path):
    raise FileNotFoundError(f"--config={spec}: {path} is not a config file (.py or .json).")
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(variant or None)


def _tokenizer_and_milestones(config):
  env = make_env(config)
  tokenizer = None
  if config.model.get("checkpoint"):
    _, _, tokenizer = checkpoint_lib.load(config.model.checkpoint)  # weights too: no lighter path
  return env.codec(tokenizer, config.env.style).tokenizer, tuple(env.milestone_names)


def _parse(argv):
  p = argparse.ArgumentParser(prog="python -m longhorizon.cli.store", description=__doc__.split(
      "\n")[0])
  p.add_argument("path", help="a training workdir, or a trajectory store directory")
  p.add_argument("--last", type=int, default=5, help="how many of the newest episodes (default 5)")
  p.add_argument("--filter", default="", help="comma-separated validity filters, each dropping "
                 f"what it names: {', '.join(store_lib.FILTERS)}")
  p.add_argument("--dedup", action="store_true", help="one episode per canonical key (the newest)")
  p.add_argument("--markup", default="ansi", choices=("ansi", "plain", "html"))
  p.add_argument("--config", default="", help="the run's config (path.py[:variant] or "
                 "config.json) when the store has no workdir config.json beside it")
  p.add_argument("--skip_corrupt", action="store_true",
                 help="leave unreadable files out (with a warning) instead of stopping")
  return p.parse_args(argv)


def main(argv=None) -> int:
  """Prints the episodes; returns the exit status (2 for a store or config problem)."""
  args = _parse(argv)
  directory, saved = locate(args.path)
  if not args.config and saved is None:
    print(f"error: no config.json in {args.path} or beside it; pass --config=CONFIG to rebuild "
          f"the run's tokenizer.", file=sys.stderr)
    return 2
  if args.last < 1:
    print(f"error: --last must be >= 1, got {args.last}.", file=sys.stderr)
    return 2
  filters = [f for f in args.filter.split(",") if f]
  try:
    store = store_lib.TrajectoryStore(directory,
                                      on_corrupt="skip" if args.skip_corrupt else "raise")
    rows = store.rows(filters=filters, dedup=args.dedup, last=args.last)
    batch = store.load(rows)
  except store_lib.StoreError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  tokenizer, milestones = _tokenizer_and_milestones(load_config(args.config or saved))
  count = len(store.files())
  dedup = " and dedup" if args.dedup else ""
  print(f"{directory}: {len(store)} episodes in {count} file{'s' if count != 1 else ''}; the "
        f"newest {len(rows)} after filters {filters or 'none'}{dedup}.")
  print(render.legend(args.markup))
  for i in range(batch.batch_size):
    print(f"\n== update {rows.update[i]} | {os.path.basename(rows.path[i])} row {rows.row[i]} | "
          f"policy v{batch.policy_version[i]} env v{batch.env_version[i]} reward "
          f"v{batch.reward_version[i]} | key {rows.key[i]}")
    print(render.render_episode(batch, i, tokenizer, markup=args.markup,
                                milestone_names=milestones))
  return 0


if __name__ == "__main__":
  sys.exit(main())

r"""Evaluates a policy (or a baseline) on an environment's task split; writes eval.json and plots.

    python experiments/evaluate.py --checkpoint=WORKDIR --out=DIR [--faults=...] [--k=8] ...
    python experiments/evaluate.py --checkpoint=MODEL|oracle|random --env=NAME --split=test|ood \
        [--k=8] [--faults=timeout:0.1,unavailable:0.05] [--num_tasks=64] --out=DIR

--checkpoint: a training workdir (its config.json and latest checkpoint), a model checkpoint
(HF folder, .gguf, or the alias `smollm2`), or one of the baselines `oracle` / `random` (so every
table has its ceiling and floor). --env is a registered name or the import path of an environment
outside the library, `package.module:Class` (its folder on PYTHONPATH). Deterministic given --seed.

A workdir is evaluated as its run was: `longhorizon.train.learner.Learner.build` builds the environment with
its wrappers (faults, tool costs, loop detection), codec, task suite (the run's `tasks.*` sizes and
seed, so the run's own test tasks) and the policy from the saved config; rollout and reward settings
come from it too. The evaluation settings default to the run's final evaluation (split `eval.split`,
`eval.num_tasks` tasks, `eval.k` attempts, temperature `rollout.temperature`, seed `seed + 17`), so
`evaluate.py --checkpoint=WORKDIR` on a finished run reproduces the final-evaluation numbers of its
eval.json (all of them but the greedy and warm-start ones, which it does not compute). Flags passed
explicitly override: --split, --k, --num_tasks, --seed, --temperature (evaluation), and --env,
--env_params, --style, --max_steps, --faults, --env_error_kinds, --task_sizes (written into the
run's config before set-up; another environment or style must keep the policy's vocabulary).

`eval.json` holds success_rate, success_ci, pass_at_k, pass_hat_k, milestone_success,
cost_per_success, recovery_rate, env_error_rate, violation_rate, unauthorized_call_rate,
collateral_damage_rate, loop_rate, truncation_rate, attack_success_rate (null where an environment
has no such notion) and per-bucket breakdowns; `eval.png` plots them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys

from absl import app
from absl import flags
from absl import logging
import ml_collections

from longhorizon import envs, rollout
from longhorizon.cli import logs
from longhorizon.envs import tasks as task_suites
from longhorizon.eval import metrics as metrics_lib
from longhorizon.eval import runner
from longhorizon.models import checkpoint as checkpoint_lib
from longhorizon.train import config as config_lib
from longhorizon.train import loop
from longhorizon.train.learner import Learner, make_env
from longhorizon.train.checkpoints import CheckpointError, Checkpointer

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Workdir, model checkpoint, 'oracle' or 'random'.")
_ENV = flags.DEFINE_string("env", None, "Environment: a registered name or 'package.module:Class' "
                           "(default: the workdir config's).")
_ENV_PARAMS = flags.DEFINE_string("env_params", None, "JSON object of environment parameters "
                                  "(default: the workdir config's, else {}).")
_TASK_SIZES = flags.DEFINE_string("task_sizes", None, "JSON object of task-suite sizes per split, "
                                  'e.g. \'{"train": 64, "test": 16}\' (default: the workdir '
                                  f"config's tasks.*_size, else {task_suites.DEFAULT_SIZES}).")
_SPLIT = flags.DEFINE_enum("split", None, ["test", "ood", "train"],
                           "Task split (default: the workdir config's eval.split, else test).")
_K = flags.DEFINE_integer("k", None, "Attempts per task, >= 1 (pass@k, pass^k for k <= K; default: "
                          "the workdir config's eval.k, else 4).")
_NUM_TASKS = flags.DEFINE_integer("num_tasks", None, "Tasks evaluated, >= 1, the first of the split "
                                  "(default: the workdir config's eval.num_tasks, else 64).")
_FAULTS = flags.DEFINE_string("faults", None, "Fault injection, e.g. 'timeout:0.1,unavailable:0.05' "
                              "(TOOL.KIND:RATE for one tool's own rates) "
                              "('' for none; default: the workdir config's env.faults, else none).")
_ENV_ERROR_KINDS = flags.DEFINE_list("env_error_kinds", None, "Faults that are env errors (default: "
                                     "the workdir config's env.env_error_kinds, else unavailable).")
_STYLE = flags.DEFINE_enum("style", None, ["compact", "tool_call"], "Codec style (default: config's).")
_TEMPERATURE = flags.DEFINE_float("temperature", None, "Sampling temperature, >= 0 (0: greedy; "
                                  "default: the workdir config's rollout.temperature, else 1).")
_MAX_STEPS = flags.DEFINE_integer("max_steps", None, "Step limit, >= 1 (default: config's or 16).")
_SEED = flags.DEFINE_integer("seed", None, "Evaluation seed (default: the workdir run's final "
                             "evaluation seed, config seed + 17, else 0).")
_OUT = flags.DEFINE_string("out", None, "Output folder for eval.json and eval.png.")
flags.mark_flags_as_required(["checkpoint", "out"])



def parse_faults(text: str) -> dict:
  """'timeout:0.1,unavailable:0.05' -> {'timeout': 0.1, 'unavailable': 0.05} (every tool);
  'lookup.unavailable:0.2' -> {'lookup': {'unavailable': 0.2}} (that tool's own rates, which
  replace the shared ones for it). Errors name the item; tool names are checked against the
  environment when it is built."""
  out = {}
  for item in filter(None, (t.strip() for t in text.split(","))):
    name, sep, rate = item.partition(":")
    if not sep:
      raise ValueError(f"--faults item {item!r} must be KIND:RATE or TOOL.KIND:RATE, e.g. "
                       f"timeout:0.1.")
    tool, _, kind = name.rpartition(".")
    if kind not in envs.FAULT_KINDS:
      raise ValueError(f"--faults kind {kind!r} is unknown; kinds: {sorted(envs.FAULT_KINDS)}.")
    try:
      value = float(rate)
    except ValueError:
      raise ValueError(f"--faults rate {rate!r} of {name!r} is not a number.") from None
    if not 0 <= value <= 1:
      raise ValueError(f"--faults rate {rate!r} of {name!r} is not a probability in [0, 1].")
    if tool:
      out.setdefault(tool, {})[kind] = value
    else:
      out[kind] = value
  return out


def parse_json_object(flag: str, text: str) -> dict:
  """The JSON object `text` of `--flag`; a ValueError naming the flag otherwise."""
  try:
    value = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"--{flag}={text!r} is not valid JSON ({e}); pass a JSON object, e.g. "
                     f"--{flag}='{{\"horizon\": 4}}'.") from None
  if not isinstance(value, dict):
    raise ValueError(f"--{flag}={text!r} is a JSON {type(value).__name__}; pass a JSON object "
                     f"(name -> value), e.g. --{flag}='{{\"horizon\": 4}}'.")
  return value


def parse_sizes(text: str) -> dict[str, int]:
  """--task_sizes: a JSON object of split -> number of tasks (each >= 1)."""
  sizes = parse_json_object("task_sizes", text)
  bad = {k: v for k, v in sizes.items() if k not in task_suites.DEFAULT_SIZES
         or isinstance(v, bool) or not isinstance(v, int) or v < 1}
  if bad:
    raise ValueError(f"--task_sizes: {bad} are not allowed; keys are splits "
                     f"{list(task_suites.DEFAULT_SIZES)}, values integers >= 1.")
  return sizes


def _validator(flag: str, check):
  """Registers `check(value)` (raising ValueError with its message) on `--flag`; None passes."""
  def checker(value):
    if value is not None:
      try:
        check(value)
      except ValueError as e:
        raise flags.ValidationError(str(e)) from None
    return True
  flags.register_validator(flag, checker)


def _at_least(flag: str, low):
  def check(value):
    if value < low:
      raise ValueError(f"--{flag}={value} is not allowed; expected a number >= {low}.")
  return check


def _fault_kinds(kinds):
  bad = [k for k in kinds if k not in envs.FAULT_KINDS]
  if bad:
    raise ValueError(f"--env_error_kinds {bad} are unknown; kinds: {sorted(envs.FAULT_KINDS)}.")


# Checked when the flags are parsed, before anything is built or loaded.
_validator("k", _at_least("k", 1))
_validator("num_tasks", _at_least("num_tasks", 1))
_validator("max_steps", _at_least("max_steps", 1))
_validator("temperature", _at_least("temperature", 0))
_validator("faults", parse_faults)
_validator("env_error_kinds", _fault_kinds)
_validator("env_params", lambda text: parse_json_object("env_params", text))
_validator("task_sizes", parse_sizes)


def _explicit(flag) -> bool:
  return flags.FLAGS[flag.name].present


def _run_config(workdir: str) -> ml_collections.ConfigDict:
  """The workdir's saved config with the explicitly passed environment and task flags applied."""
  with open(os.path.join(workdir, "config.json")) as f:
    config = ml_collections.ConfigDict(json.load(f))
  overrides = {
      "env.name": _ENV, "env.style": _STYLE, "env.max_steps": _MAX_STEPS,
      "env.params": _ENV_PARAMS, "env.faults": _FAULTS, "env.env_error_kinds": _ENV_ERROR_KINDS}
  for path, flag in overrides.items():
    if _explicit(flag):
      value = flag.value
      if flag is _ENV_PARAMS:
        value = parse_json_object("env_params", value)
      elif flag is _FAULTS:
        value = parse_faults(value)
      logging.info("--%s overrides the run's config.%s.", flag.name, path)
      config_lib.set_path(config, path, value)
  if _explicit(_TASK_SIZES):
    for split, size in parse_sizes(_TASK_SIZES.value).items():
      config_lib.set_path(config, f"tasks.{split}_size", size)
  return config


@dataclasses.dataclass
class _Evaluation:
  """What one evaluation runs on, with the defaults of the evaluation flags."""
  env: envs.Environment  # wrapped: TimeLimit, faults, ...
  codec: envs.Codec
  source: object  # the split's task data source (`tasks.load`)
  rollout_config: rollout.RolloutConfig
  policy: dict  # {"params", "model_config"}, or {} for a baseline
  defaults: dict  # split, k, num_tasks, seed, env, faults
  context: object = contextlib.nullcontext()  # the run's device mesh, if it had one


def _from_workdir(workdir: str) -> _Evaluation:
  """A training run as it evaluated itself: its `Learner` from its saved config (plus overrides)."""
  config = _run_config(workdir)
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"))
  try:
    if checkpointer.latest_step() is None:
      raise CheckpointError(f"--checkpoint={workdir}: the run has no checkpoint yet (one is saved "
                            "after the warm start); evaluate it once training has saved one.")
    s = Learner.build(config)  # validates the config first
    state, meta = checkpointer.restore(template=s.with_reference(s.initial_state()))
  finally:
    checkpointer.close()
  logging.info("Evaluating %s at update %s.", workdir, meta.get("update"))
  split = _SPLIT.value or config.eval.split
  temperature = _TEMPERATURE.value if _TEMPERATURE.value is not None else config.rollout.temperature
  return _Evaluation(
      env=s.env, codec=s.codec, source=s.eval_tasks.get(split, s.train_tasks),
      rollout_config=s.collect_config(temperature=temperature),
      policy={"params": state.params, "model_config": s.model_config},
      defaults={"split": split, "k": config.eval.k, "num_tasks": config.eval.num_tasks,
                "seed": loop.eval_seed(config), "env": config.env.name,
                "faults": dict(config.env.faults)},
      context=s.in_mesh())


def _from_flags(ckpt: str) -> _Evaluation:
  """A model checkpoint or a baseline: everything from the flags and their defaults."""
  env_params = parse_json_object("env_params", _ENV_PARAMS.value or "{}")
  faults = parse_faults(_FAULTS.value or "")
  env_config = ml_collections.ConfigDict({
      "name": _ENV.value, "params": env_params, "max_steps": _MAX_STEPS.value or 16,
      "faults": faults, "env_error_kinds": tuple(("unavailable",) if _ENV_ERROR_KINDS.value is None
                                 else _ENV_ERROR_KINDS.value),
      "tool_costs": {}, "loop_k": 0})
  env = make_env(ml_collections.ConfigDict({"env": env_config}))  # before any model loads
  policy, tokenizer = {}, None
  if ckpt not in runner.BASELINES:
    model_config, params, tokenizer = checkpoint_lib.load(ckpt)
    policy = {"params": params, "model_config": model_config}
  codec = env.codec(tokenizer, _STYLE.value or ("tool_call" if tokenizer is not None else "compact"))
  split = _SPLIT.value or "test"
  sizes = parse_sizes(_TASK_SIZES.value or "{}")
  temperature = _TEMPERATURE.value if _TEMPERATURE.value is not None else 1.0
  return _Evaluation(
      env=env, codec=codec,
      source=task_suites.load(_ENV.value, split, env_params=env_params, seed=0, sizes=sizes),
      rollout_config=rollout.RolloutConfig(group_size=1, max_steps=env_config.max_steps,
                                           context_length=1024, turn_tokens=64,
                                           temperature=temperature),
      policy=policy,
      defaults={"split": split, "k": 4, "num_tasks": 64, "seed": 0, "env": _ENV.value,
                "faults": faults})


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logs.setup()  # absl at INFO; each record once; orbax INFO and asyncio noise dropped
  ckpt = _CHECKPOINT.value
  is_workdir = ckpt not in runner.BASELINES and os.path.exists(os.path.join(ckpt, "config.json"))
  if _ENV.value is None and not is_workdir:
    raise app.UsageError("--env is required unless --checkpoint is a training workdir (a folder "
                         "with config.json).")
  if _ENV.value is not None:
    try:
      envs.resolve(_ENV.value)  # a wrong name fails here, before a model is loaded
    except ValueError as e:
      raise app.UsageError(f"--env={_ENV.value}: {e}") from None
  try:
    ev = _from_workdir(ckpt) if is_workdir else _from_flags(ckpt)
  except (config_lib.ConfigError, CheckpointError, task_suites.CorruptSuiteError) as e:
    # A config field, checkpoint or task suite the user can fix: the message names it.
    logging.error("%s", e)
    sys.exit(2)
  k = _K.value or ev.defaults["k"]
  seed = _SEED.value if _SEED.value is not None else ev.defaults["seed"]
  n = min(_NUM_TASKS.value or ev.defaults["num_tasks"], len(ev.source))
  tasks = task_suites.stack(ev.source, range(n))
  name = "model" if ev.policy else ckpt
  with ev.context:
    report, _ = runner.evaluate(ev.env, ev.codec, tasks, attempts=k,
                                rollout_config=ev.rollout_config, policy=name, seed=seed,
                                **ev.policy)
  report.update(checkpoint=ckpt, env=ev.defaults["env"], split=ev.defaults["split"], k=k, seed=seed,
                temperature=ev.rollout_config.temperature, faults=ev.defaults["faults"])
  os.makedirs(_OUT.value, exist_ok=True)
  with open(os.path.join(_OUT.value, "eval.json"), "w") as f:
    json.dump(report, f, indent=2, sort_keys=True)
  metrics_lib.plot_report([(name, report)], os.path.join(_OUT.value, "eval.png"))
  print(json.dumps({k: report[k] for k in ("success_rate", "success_ci", "pass_at_k", "pass_hat_k")}))


if __name__ == "__main__":
  app.run(main)

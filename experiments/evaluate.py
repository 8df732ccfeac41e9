r"""Evaluates a policy (or a baseline) on an environment's task split; writes eval.json and plots.

    python experiments/evaluate.py --checkpoint=DIR_OR_ALIAS --env=NAME --split=test|ood [--k=8]
        [--faults=timeout:0.1,unavailable:0.05] [--num_tasks=64] --out=DIR

--checkpoint: a training workdir (its config.json and latest checkpoint), a model checkpoint
(HF folder, .gguf, or the alias `smollm2`), or one of the baselines `oracle` / `random` (so every
table has its ceiling and floor). Deterministic given --seed. `eval.json` holds success_rate,
success_ci, pass_at_k, pass_hat_k, milestone_success, cost_per_success, recovery_rate,
env_error_rate, violation_rate, unauthorized_call_rate, collateral_damage_rate, loop_rate,
truncation_rate, attack_success_rate (null where an environment has no such notion) and per-bucket
breakdowns; `eval.png` plots them.
"""

from __future__ import annotations

import json
import os

from absl import app
from absl import flags
from absl import logging
import jax
import ml_collections

from longhorizon import envs, rollout
from longhorizon.envs import tasks as task_suites
from longhorizon.eval import metrics as metrics_lib
from longhorizon.eval import runner

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Workdir, model checkpoint, 'oracle' or 'random'.")
_ENV = flags.DEFINE_string("env", None, "Environment name (default: the workdir config's).")
_ENV_PARAMS = flags.DEFINE_string("env_params", "{}", "JSON object of environment parameters.")
_SPLIT = flags.DEFINE_enum("split", "test", ["test", "ood", "train"], "Task split.")
_K = flags.DEFINE_integer("k", 4, "Attempts per task (pass@k, pass^k for k <= K).")
_NUM_TASKS = flags.DEFINE_integer("num_tasks", 64, "Tasks evaluated (the first of the split).")
_FAULTS = flags.DEFINE_string("faults", "", "Fault injection, e.g. 'timeout:0.1,unavailable:0.05'.")
_ENV_ERROR_KINDS = flags.DEFINE_list("env_error_kinds", ["unavailable"], "Faults that are env errors.")
_STYLE = flags.DEFINE_enum("style", None, ["compact", "tool_call"], "Codec style (default: config's).")
_TEMPERATURE = flags.DEFINE_float("temperature", None, "Sampling temperature (default: config's).")
_MAX_STEPS = flags.DEFINE_integer("max_steps", None, "Step limit (default: config's or 16).")
_SEED = flags.DEFINE_integer("seed", 0, "Evaluation seed.")
_OUT = flags.DEFINE_string("out", None, "Output folder for eval.json and eval.png.")
flags.mark_flags_as_required(["checkpoint", "out"])


def parse_faults(text: str) -> dict[str, float]:
  """'timeout:0.1,unavailable:0.05' -> {'timeout': 0.1, 'unavailable': 0.05}; errors name the item."""
  out = {}
  for item in filter(None, (t.strip() for t in text.split(","))):
    name, sep, rate = item.partition(":")
    if not sep:
      raise ValueError(f"--faults item {item!r} must be KIND:RATE, e.g. timeout:0.1.")
    if name not in envs.FAULT_KINDS:
      raise ValueError(f"--faults kind {name!r} is unknown; kinds: {sorted(envs.FAULT_KINDS)}.")
    try:
      out[name] = float(rate)
    except ValueError:
      raise ValueError(f"--faults rate {rate!r} of {name!r} is not a number.") from None
  return out


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  logging.get_absl_handler().addFilter(
      lambda record: "/orbax/" not in record.pathname
      and "/tensorflow_datasets/" not in record.pathname)
  ckpt = _CHECKPOINT.value
  config, params, model_config, tokenizer = None, None, None, None
  workdir_config = os.path.join(ckpt, "config.json") if ckpt not in runner.BASELINES else ""
  if workdir_config and os.path.exists(workdir_config):
    from longhorizon.train import loop
    from longhorizon.train.checkpoints import Checkpointer
    with open(workdir_config) as f:
      config = ml_collections.ConfigDict(json.load(f))
    s = loop.setup(config)
    checkpointer = Checkpointer(os.path.join(ckpt, "checkpoints"))
    state, meta = checkpointer.restore(template=loop.with_reference(s, loop.initial_state(s)))
    logging.info("Evaluating %s at update %s.", ckpt, meta.get("update"))
    params, model_config, tokenizer = state.params, s.model_config, s.codec.tokenizer
  elif ckpt not in runner.BASELINES:
    from longhorizon.models import checkpoint as checkpoint_lib
    model_config, params, tokenizer = checkpoint_lib.load(ckpt)
  env_name = _ENV.value or (config.env.name if config else None)
  if env_name is None:
    raise app.UsageError("--env is required unless --checkpoint is a training workdir.")
  env_params = json.loads(_ENV_PARAMS.value) or (dict(config.env.params) if config else {})
  style = _STYLE.value or (config.env.style if config else
                           ("tool_call" if tokenizer is not None else "compact"))
  max_steps = _MAX_STEPS.value or (config.env.max_steps if config else 16)
  env = envs.TimeLimit(envs.make(env_name, **env_params), max_steps)
  faults = parse_faults(_FAULTS.value)
  if faults:
    env = envs.FaultInjection(env, faults, tuple(_ENV_ERROR_KINDS.value))
  codec = env.codec(tokenizer, style)
  data_dir = (config.tasks.data_dir or None) if config else None
  source = task_suites.load(env_name, _SPLIT.value, env_params=env_params,
                            seed=config.tasks.seed if config else 0, data_dir=data_dir)
  n = min(_NUM_TASKS.value, len(source))
  tasks = task_suites.stack(source, range(n))
  temperature = _TEMPERATURE.value if _TEMPERATURE.value is not None else (
      config.rollout.temperature if config else 1.0)
  rc = rollout.RolloutConfig(
      group_size=_K.value, max_steps=max_steps, temperature=temperature,
      context_length=config.rollout.context_length if config else 1024,
      turn_tokens=config.rollout.turn_tokens if config else 64)
  policy = ckpt if ckpt in runner.BASELINES else "model"
  report, _ = runner.evaluate(env, codec, tasks, attempts=_K.value, rollout_config=rc,
                              policy=policy, params=params, model_config=model_config,
                              seed=_SEED.value)
  report.update(checkpoint=ckpt, env=env_name, split=_SPLIT.value, k=_K.value,
                temperature=temperature, faults=faults)
  os.makedirs(_OUT.value, exist_ok=True)
  with open(os.path.join(_OUT.value, "eval.json"), "w") as f:
    json.dump(report, f, indent=2, sort_keys=True)
  metrics_lib.plot_report([(policy, report)], os.path.join(_OUT.value, "eval.png"))
  print(json.dumps({k: report[k] for k in ("success_rate", "success_ci", "pass_at_k", "pass_hat_k")}))


if __name__ == "__main__":
  app.run(main)

"""The typed options: every field of every options class is settable from the command line of
experiments/train.py (`--config.<section>.<field>=...`), has one default, and validates itself."""

import dataclasses
import math
import os

from absl import flags
from ml_collections import config_flags
import pytest

from longhorizon.envs import RewardSpec
from longhorizon.rollout import RolloutConfig
from longhorizon.train import config as config_lib
from longhorizon.train.algorithms import AlgorithmOptions
from longhorizon.train.options import ConfigError, RolloutOptions
from longhorizon.train.policy_losses import POLICY_LOSSES, LossOptions

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
DEFAULT = os.path.join(ROOT, "configs", "default.py")


def _parse(*overrides):
  """The config experiments/train.py gets for `--config=configs/default.py <overrides>`."""
  argv = ["train.py", f"--config={DEFAULT}", *overrides]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True,
                                  sys_argv=argv)
  fv(argv)
  return fv.config


def test_train_py_takes_its_config_through_the_same_flag():
  with open(os.path.join(ROOT, "experiments", "train.py"), encoding="utf-8") as f:
    source = f.read()
  assert 'config_flags.DEFINE_config_file(\n    "config"' in source or \
      'config_flags.DEFINE_config_file("config"' in source


def _other_values(field: dataclasses.Field):
  """Valid-looking values of `field` other than its default, most likely to validate first."""
  default, meta = field.default, field.metadata
  choices = meta.get("choices")
  if choices is not None:
    return [c for c in (choices() if callable(choices) else choices) if c != default]
  if isinstance(default, bool):
    return [not default]
  if isinstance(default, str):  # free text (a path)
    return [default + "elsewhere.jsonl"]
  if isinstance(default, tuple) and default and all(isinstance(x, float) for x in default):
    return [tuple(0.5 * x for x in default)]  # weights, e.g. algorithm.part_weights
  if isinstance(default, tuple):  # pairs, e.g. pool.tool_rate_limits
    return [(("refund", 2.0),)]
  valid = meta["range"]
  if valid.kind is int:
    raw = [default * 2, default + 1, default - 1, int(valid.low) if valid.low > -math.inf else 0]
  else:
    raw = [default / 2, default * 0.9, default + 0.05, 0.5, 1.5, 0.05]
  return [v for v in raw if valid.holds(v) and v != default]


def _flag_text(value) -> str:
  return str(value)


SPECS = config_lib.SPECS
# Options that apply only together with others: the flags that make them valid.
_COMPANIONS = {"algorithm.time_discount": ("--config.algorithm.name=gigpo",
                                           "--config.algorithm.time_source=cost"),
               "algorithm.critic": ("--config.algorithm.name=ppo",),
               "rollout.continue_partial": ("--config.rollout.mode=async",)}


def _fields():
  for spec in SPECS:
    for field in dataclasses.fields(spec):
      yield pytest.param(spec, field, id=f"{spec.SECTION}.{field.name}")


@pytest.mark.parametrize("spec,field", list(_fields()))
def test_every_option_is_reachable_from_the_command_line(spec, field):
  """Set `--config.<section>.<field>` to another valid value: the validated config accepts it and
  the options object the learner builds (`spec.from_config`) carries it."""
  tried = []
  for value in _other_values(field):
    path = f"{spec.SECTION}.{field.name}"
    config = _parse(f"--config.{path}={_flag_text(value)}", *_COMPANIONS.get(path, ()))
    try:
      config_lib.validate(config)
    except ConfigError as e:
      tried.append((value, str(e)))
      continue
    assert getattr(spec.from_config(config), field.name) == value
    return
  pytest.fail(f"no other value of {spec.__name__}.{field.name} validated: {tried}")


def test_rollout_config_fields_come_from_the_config():
  """`rollout.RolloutConfig` (what `collect` takes) is built from `config.rollout` and
  `config.env.max_steps`: each of its fields is reachable through them."""
  config = _parse("--config.rollout.group_size=4", "--config.rollout.context_length=200",
                  "--config.env.max_steps=7", "--config.rollout.turn_tokens=9",
                  "--config.rollout.temperature=0.7", "--config.rollout.top_k=5",
                  "--config.rollout.top_p=0.9")
  rc = RolloutOptions.from_config(config).collect_config(config.env.max_steps)
  assert dataclasses.asdict(rc) == {"group_size": 4, "context_length": 200, "max_steps": 7,
                                    "turn_tokens": 9, "temperature": 0.7, "top_k": 5,
                                    "top_p": 0.9, "branch_k": 0, "branch_at": "uniform",
                                    "record_oracle": False, "label_parts": False,
                                    "step_budget": 0, "share_prompts": False,
                                    "recovery_from": "", "context_mode": "full",
                                    "context_every": 0, "context_keep": 2,
                                    "context_segments": 4, "context_summary_by": "env",
                                    "context_summary_tokens": 24}
  branched = _parse("--config.rollout.group_size=4", "--config.rollout.branch_k=1",
                    "--config.rollout.branch_at=max_entropy")
  options = RolloutOptions.from_config(branched)
  assert options.collect_config(5).branch_k == 0  # evaluation and SFT episodes never branch
  rc = options.collect_config(5, branch=True)
  assert (rc.branch_k, rc.branch_at, rc.branch_roots) == (1, "max_entropy", 2)
  assert {f.name for f in dataclasses.fields(RolloutConfig)} == set(dataclasses.asdict(rc))
  recovering = RolloutOptions.from_config(_parse("--config.rollout.recovery_groups=2",
                                                 "--config.rollout.recovery_from=after_error"))
  assert recovering.collect_config(5).recovery_from == ""  # evaluation keeps no starts
  assert recovering.collect_config(5, branch=True).recovery_from == "after_error"


def test_reward_fields_come_from_the_config():
  """Every `RewardSpec` field is a `config.reward` field, and the environment a run builds carries
  the config's reward (so the environment's own step reward and training's agree)."""
  from longhorizon.train.learner import make_env
  config = _parse("--config.reward.milestone=0.25", "--config.reward.invalid=0.5")
  names = {f.name for f in dataclasses.fields(RewardSpec)}
  assert set(config.reward.keys()) == names
  assert make_env(config).reward_spec == RewardSpec(milestone=0.25, invalid=0.5)
  config.unlock()
  config.env.params = {"horizon": 3, "success": 2.0}
  with pytest.raises(ConfigError, match=r"config.env.params sets \['success'\]"):
    make_env(config)


def test_one_default_each():
  """configs/default.py's typed sections are the options classes' defaults, written once."""
  config = _parse()
  for spec in SPECS:
    assert spec.from_config(config) == spec(), spec.__name__


def test_options_validate_themselves_naming_the_field():
  with pytest.raises(ConfigError, match=r"config.loss.clip_low=1.5 is not allowed; expected a "
                                        r"number in \[0, 1\)"):
    LossOptions(clip_low=1.5)
  with pytest.raises(ConfigError, match=r"config.algorithm.name='ppo3'.*one of \["):
    AlgorithmOptions(name="ppo3")
  with pytest.raises(ConfigError, match="config.loss.tis_threshold=0.0"):
    LossOptions(name="tis")
  with pytest.raises(ConfigError, match="config.rollout.mode='later'"):
    RolloutOptions(mode="later")
  with pytest.raises(ConfigError, match="config.algorithm.normalize_std='yes'.*True or False"):
    AlgorithmOptions(normalize_std="yes")


def test_choices_come_from_the_registries():
  """A loss registered after import is a valid choice at once (no copied list)."""
  from longhorizon.train import policy_losses
  name = "test_only_loss"
  policy_losses.register(policy_losses.PolicyLoss(name, POLICY_LOSSES["ppo_clip"].fn))
  try:
    assert LossOptions(name=name).spec.name == name
  finally:
    del POLICY_LOSSES[name]
  with pytest.raises(ConfigError):
    LossOptions(name=name)


def test_section_and_class_must_match():
  config = _parse()
  config.unlock()
  config.loss.clip_lo = 0.1
  with pytest.raises(ConfigError, match=r"config.loss does not match LossOptions: unknown "
                                        r"field\(s\) \['clip_lo'\]"):
    LossOptions.from_config(config)

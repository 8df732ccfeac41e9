"""The README's one-file host environment (`examples/guess_word.py`): the README shows the file as
it is, and it runs through the real rollout loop and the learner's set-up."""

import os
import sys

import jax
import numpy as np

from longhorizon import envs, rollout
from longhorizon.train import learner as learner_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "guess_word.py")


def test_readme_shows_the_example_file_verbatim():
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    readme = f.read()
  with open(EXAMPLE, encoding="utf-8") as f:
    example = f.read()
  assert f"```python\n{example}```" in readme
  code = [line for line in example.splitlines() if line.strip() and not line.startswith('"""')]
  assert len(code) <= 32  # "a 30-line example"


def _env():
  sys.path.insert(0, os.path.dirname(EXAMPLE))
  try:
    return envs.make("guess_word:GuessWord")
  finally:
    sys.path.remove(os.path.dirname(EXAMPLE))


def test_example_oracle_solves_every_task_through_the_text_path():
  env = _env()
  codec = env.codec()
  tasks = env.tasks("test", 8, 0)
  config = rollout.RolloutConfig(group_size=2, context_length=64, max_steps=6, turn_tokens=4)
  batch, stats = rollout.collect(None, None, env, codec, tasks, jax.random.split(jax.random.key(0), 8),
                                 config, sampling_seed=0, scripted=rollout.oracle_turns(env, codec))
  assert batch.success.all() and (batch.num_steps == 4).all()
  assert stats.unknown_words == 0 and stats.as_dict()["pool/validity_rate"] == 1.0
  # A wrong guess fails, malformed text is an invalid action (the episode goes on), not a crash.
  env.reset(tasks[0], 0)
  wrong = next(w for w in ("apple", "brick") if w != tasks[0]["secret"])
  assert env.step("hello there").error == envs.ErrorCode.UNKNOWN_TOOL
  result = env.step(f"answer {wrong}")
  assert result.terminated and not result.success


def test_example_builds_a_learner_from_the_default_config():
  import importlib.util
  spec = importlib.util.spec_from_file_location("default_config", os.path.join(ROOT, "configs",
                                                                             "default.py"))
  default = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(default)
  config = default.get_config("smoke")
  env = _env()
  envs.register("guess_word_test", lambda **kw: type(env)(**kw), overwrite=True)
  config.env.name, config.env.params, config.env.max_steps = "guess_word_test", {}, 6
  config.pool.backend, config.pool.retries = "thread", 1
  s = learner_lib.Learner.build(config)
  assert envs.is_host(s.env) and len(s.train_tasks) == config.tasks.train_size
  assert s.env.reward_spec == envs.RewardSpec(**config.reward)
  assert s.model_config.vocab_size == len(s.codec.tokenizer)

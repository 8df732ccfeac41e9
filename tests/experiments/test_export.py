"""experiments/export.py on a LoRA run: the merged HF model computes the run's policy, and the
adapters on the exported base compute the same, and `--adapters_only` writes those adapters alone."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from longhorizon.models import Transformer, checkpoint, lora
from longhorizon.train.checkpoints import Checkpointer
from longhorizon.train.learner import Learner

ROOT = pathlib.Path(__file__).parents[2]


def _restore(workdir):
  """The run's learner and latest parameters (the script defines absl flags, so it is not imported
  into the test process: another test module defines --out too)."""
  config = ml_collections.ConfigDict(json.loads((workdir / "config.json").read_text()))
  learner = Learner.build(config)
  checkpointer = Checkpointer(str(workdir / "checkpoints"))
  try:
    state, _ = checkpointer.restore(template=learner.with_reference(learner.initial_state()))
  finally:
    checkpointer.close()
  return learner, jax.device_get(state.params)


@pytest.mark.slow
def test_export_of_a_lora_run(tmp_path):
  workdir, out = tmp_path / "run", tmp_path / "export"
  subprocess.run([sys.executable, str(ROOT / "experiments" / "train.py"),
                  "--config=" + str(ROOT / "configs" / "default.py") + ":smoke",
                  "--config.model.lora.rank=4", "--config.tasks.data_dir=" + str(tmp_path / "tasks"),
                  f"--workdir={workdir}"], check=True, capture_output=True, timeout=900)
  subprocess.run([sys.executable, str(ROOT / "experiments" / "export.py"), f"--workdir={workdir}",
                  f"--out={out}"], check=True, capture_output=True, timeout=600)
  learner, params = _restore(workdir)
  config = learner.model_config
  assert config.lora_rank == 4
  assert any(np.abs(np.asarray(x)).max() > 0 for x in jax.tree.leaves(lora.adapters(params))
             if x.shape[1] == 4)  # trained lora_b leaves ([L, r, out]) moved off zero
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 12)))
  want = np.asarray(Transformer(config).apply({"params": params}, tokens).logits)

  merged_config, merged, tokenizer = checkpoint.load(out / "merged")
  assert merged_config.lora_rank == 0 and tokenizer is not None
  np.testing.assert_allclose(
      np.asarray(Transformer(merged_config).apply({"params": merged}, tokens).logits), want,
      atol=1e-5)

  base_config, base, _ = checkpoint.load(out / "base")
  adapted = lora.load_adapters(out / "adapters", lora.add_adapters(base, config, jax.random.key(0)),
                               config)
  np.testing.assert_allclose(
      np.asarray(Transformer(config).apply({"params": adapted}, tokens).logits), want, atol=1e-5)
  assert base_config.lora_rank == 0

  # --adapters_only writes the same adapters and nothing else.
  subprocess.run([sys.executable, str(ROOT / "experiments" / "export.py"), f"--workdir={workdir}",
                  f"--out={tmp_path / 'only'}", "--adapters_only"], check=True,
                 capture_output=True, timeout=600)
  assert sorted(p.name for p in (tmp_path / "only").iterdir()) == ["adapters"]
  assert lora.adapter_digest(tmp_path / "only" / "adapters") == lora.adapter_digest(
      out / "adapters")


def test_adapters_only_refuses_a_run_without_lora(tmp_path):
  """A run whose saved config has `model.lora.rank` 0 is refused by name from config.json alone:
  this workdir has no checkpoint, so without the check the script would fail on that instead."""
  from longhorizon.studies import sweeps
  from longhorizon.train import workdir as workdir_lib
  config = sweeps.config_module(str(ROOT / "configs" / "default.py")).get_config()
  assert config.model.lora.rank == 0
  workdir_lib.save_config(str(tmp_path), config, 0, {})
  result = subprocess.run([sys.executable, str(ROOT / "experiments" / "export.py"),
                           f"--workdir={tmp_path}", f"--out={tmp_path / 'out'}", "--adapters_only"],
                          capture_output=True, text=True, timeout=300)
  assert result.returncode != 0
  assert "--adapters_only: the run in" in result.stderr and "model.lora.rank is 0" in result.stderr
  assert not (tmp_path / "out").exists()

"""experiments/export.py on a LoRA run: the merged HF model computes the run's policy, and the
adapters on the exported base compute the same."""

import importlib.util
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon.models import Transformer, checkpoint, lora

ROOT = pathlib.Path(__file__).parents[2]
_spec = importlib.util.spec_from_file_location("export_script", ROOT / "experiments" / "export.py")
export_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(export_script)


@pytest.mark.slow
def test_export_of_a_lora_run(tmp_path):
  workdir, out = tmp_path / "run", tmp_path / "export"
  subprocess.run([sys.executable, str(ROOT / "experiments" / "train.py"),
                  "--config=" + str(ROOT / "configs" / "default.py") + ":smoke",
                  "--config.model.lora.rank=4", "--config.tasks.data_dir=" + str(tmp_path / "tasks"),
                  f"--workdir={workdir}"], check=True, capture_output=True, timeout=900)
  subprocess.run([sys.executable, str(ROOT / "experiments" / "export.py"), f"--workdir={workdir}",
                  f"--out={out}"], check=True, capture_output=True, timeout=600)
  learner, params, _ = export_script.restore_policy(str(workdir))
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

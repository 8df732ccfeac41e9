r"""Exports a training run's policy as HuggingFace folders.

    python experiments/export.py --workdir=WORKDIR --out=DIR [--step=N] [--adapters_only]

Writes, from the run's latest checkpoint (or `--step`):
  DIR/merged/    a plain HF model (config.json, model.safetensors, tokenizer files): with LoRA, the
                 adapters merged into the base weights (`models.checkpoint.save`).
  DIR/adapters/  (LoRA runs only) the adapters alone in HF peft's layout (adapter_model.safetensors,
                 adapter_config.json: `models.lora.save_adapters`), and
  DIR/base/      the base model they apply to (the run's frozen weights), so that
                 `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(DIR/base),
                 DIR/adapters)` computes DIR/merged.
With `--adapters_only` (LoRA runs) only DIR/adapters/ is written: the folder
`--config.model.lora.init` starts a new run from (e.g. a saved SFT warm start: the adapters
alone, where a training checkpoint holds the frozen base weights too: 19.6 MB against ~540 MB
for SmolLM2).
The run is rebuilt from its saved config (`Learner.build`), as evaluate.py does.
"""

from __future__ import annotations

import json
import os

from absl import app
from absl import flags
from absl import logging
import jax
import ml_collections

from longhorizon.cli import logs
from longhorizon.models import checkpoint as checkpoint_lib
from longhorizon.models import lora
from longhorizon.train.checkpoints import CheckpointError, Checkpointer
from longhorizon.train.learner import Learner

_WORKDIR = flags.DEFINE_string("workdir", None, "A training workdir (config.json, checkpoints/).")
_OUT = flags.DEFINE_string("out", None, "Output folder (merged/, and adapters/ + base/ for LoRA).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest that restores).")
_ADAPTERS_ONLY = flags.DEFINE_bool("adapters_only", False, "LoRA runs: write DIR/adapters/ alone "
                                   "(no merged model, no base copy).")
flags.mark_flags_as_required(["workdir", "out"])


def restore_policy(workdir: str, step: int | None = None):
  """`(learner, params, meta)` of a run's checkpoint."""
  if not os.path.isfile(os.path.join(workdir, "config.json")):
    raise app.UsageError(f"--workdir={workdir}: no config.json there; expected a training workdir "
                         "(experiments/train.py --workdir=...).")
  with open(os.path.join(workdir, "config.json")) as f:
    config = ml_collections.ConfigDict(json.load(f))
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"))
  try:
    if checkpointer.latest_step() is None:
      raise CheckpointError(f"--workdir={workdir}: the run has no checkpoint yet.")
    learner = Learner.build(config)
    state, meta = checkpointer.restore(step, template=learner.with_reference(learner.initial_state()))
  finally:
    checkpointer.close()
  return learner, jax.device_get(state.params), meta


def export(learner: Learner, params, out: str, adapters_only: bool = False) -> dict[str, str]:
  """Writes the merged model (and for LoRA the adapters and their base), or with `adapters_only`
  the adapters alone; returns the folders."""
  if adapters_only:
    if not learner.model_config.lora_rank:
      raise app.UsageError("--adapters_only: the run has no LoRA adapters (model.lora.rank is 0).")
    return {"adapters": str(lora.save_adapters(os.path.join(out, "adapters"), params,
                                               learner.model_config,
                                               base_model=learner.config.model.checkpoint))}
  tokenizer = learner.codec.tokenizer
  tokenizer = tokenizer if hasattr(tokenizer, "save_pretrained") else None
  config = learner.model_config
  folders = {"merged": str(checkpoint_lib.save(os.path.join(out, "merged"), config, params,
                                               tokenizer))}
  if config.lora_rank:
    base = checkpoint_lib.save(os.path.join(out, "base"), lora.base_config(config),
                               lora.base_params(params), tokenizer)
    folders["base"] = str(base)
    folders["adapters"] = str(lora.save_adapters(os.path.join(out, "adapters"), params, config,
                                                 base_model=str(base)))
  return folders


def _require_adapters(workdir: str) -> None:
  """`--adapters_only` on a run without LoRA is refused from its saved config, before the
  checkpoint (for SmolLM2 ~540 MB) is read."""
  path = os.path.join(workdir, "config.json")
  if os.path.isfile(path):
    with open(path) as f:
      rank = json.load(f).get("model", {}).get("lora", {}).get("rank", 0)
    if not rank:
      raise app.UsageError(f"--adapters_only: the run in {workdir} has no LoRA adapters "
                           "(model.lora.rank is 0).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logs.setup()
  if _ADAPTERS_ONLY.value:
    _require_adapters(_WORKDIR.value)
  learner, params, meta = restore_policy(_WORKDIR.value, _STEP.value)
  folders = export(learner, params, _OUT.value, _ADAPTERS_ONLY.value)
  logging.info("Exported %s (update %s): %s", _WORKDIR.value, meta.get("update"), folders)
  print(json.dumps(folders, indent=1))


if __name__ == "__main__":
  app.run(main)

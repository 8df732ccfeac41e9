"""The generate entry point end to end on the real SmolLM2 checkpoint."""

import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).parents[2]
QUESTION = '[{"role":"user","content":"What is the capital of France? Answer in one sentence."}]'


def _run(*flags, timeout=600):
  return subprocess.run([sys.executable, str(ROOT / "experiments" / "generate.py"), *flags],
                        capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.slow
def test_generate_answers_paris_and_dumps_the_prompt_logits(tmp_path):
  dump = tmp_path / "out.npz"
  result = _run("--checkpoint=smollm2", f"--messages={QUESTION}", "--temperature=0",
                "--max_new_tokens=24", f"--dump_logits={dump}")
  assert result.returncode == 0, result.stderr[-3000:]
  reply = result.stdout.strip()
  assert "Paris" in reply and reply.endswith("."), reply
  saved = np.load(dump)
  reference = np.load(ROOT / "tests" / "data" / "smollm2_reference.npz", allow_pickle=False)
  ids_keys = [k for k in reference.files if "input_ids" in k]
  assert any(np.array_equal(saved["input_ids"], reference[k]) for k in ids_keys)
  assert saved["last_logits"].shape == (49152,) and saved["last_logits"].dtype == np.float32


def test_generate_rejects_bad_messages():
  result = _run("--checkpoint=smollm2", "--messages=[{not json")
  assert result.returncode != 0
  assert "--messages is not valid JSON" in result.stderr
  result = _run("--checkpoint=no_such_alias", "--prompt=hi")
  assert result.returncode != 0 and "unknown checkpoint alias 'no_such_alias'" in result.stderr

"""The generate entry point end to end on the real SmolLM2 checkpoint: the reply, the flag checks made
before anything loads, and the context check made before the KV cache is allocated."""

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


# A checkpoint that does not exist: a flag check that ran after loading would report it instead.
@pytest.mark.parametrize("flag, expected", [
    ("--max_new_tokens=0", "flag --max_new_tokens=0: must be an integer >= 1"),
    ("--temperature=-1", "flag --temperature=-1.0: must be a finite number >= 0"),
    ("--temperature=nan", "flag --temperature=nan: must be a finite number >= 0"),
    ("--top_k=-1", "flag --top_k=-1: must be an integer >= 0"),
    ("--top_p=0", "flag --top_p=0.0: must be in (0, 1]"),
    ('--messages=[{"role":"bogus","content":"hi"}]',
     "--messages[0] has role 'bogus'; allowed roles: system, user, assistant, tool."),
    ('--messages=[{"role":"user"}]', '--messages[0] must be an object with string "role" and "content"'),
    ('--messages={"role":"user","content":"hi"}', "--messages must be a non-empty JSON list"),
    ("--messages=[{not json", "flag --messages=[{not json: --messages is not valid JSON"),
])
@pytest.mark.slow  # over 10 s on a 2-core AMD EPYC with the test compile settings (BUILD_NOTES)
def test_bad_flags_are_refused_before_the_checkpoint_loads(flag, expected):
  prompt = () if flag.startswith("--messages") else ("--prompt=hi",)
  result = _run("--checkpoint=no_such_alias", *prompt, flag, timeout=120)
  assert result.returncode != 0
  assert "Flags parsing error" in result.stderr and expected in result.stderr, result.stderr[-2000:]
  assert "no_such_alias" not in result.stderr


def test_exactly_one_of_messages_and_prompt():
  for flags in [(), ("--prompt=hi", f"--messages={QUESTION}")]:
    result = _run("--checkpoint=no_such_alias", *flags, timeout=120)
    assert result.returncode != 0
    assert "give exactly one of --messages (a chat) or --prompt (raw text)" in result.stderr


def test_prompt_longer_than_the_context_is_refused_before_generating():
  # "hello " is one token: 9,001 of them (plus the trailing space) exceed SmolLM2's 8,192 positions.
  result = _run("--checkpoint=smollm2", "--prompt=" + "hello " * 9001, timeout=120)
  assert result.returncode != 0
  assert ("The prompt has 9002 tokens, but the model's context is 8192 tokens "
          "(max_position_embeddings); shorten it to at most 8191 tokens.") in result.stderr
  assert "KV cache: " not in result.stderr  # no cache was allocated


def test_max_new_tokens_beyond_the_context_is_refused_before_allocating():
  result = _run("--checkpoint=smollm2", "--prompt=hi", "--max_new_tokens=1000000000", timeout=120)
  assert result.returncode != 0
  assert ("The prompt has 1 token and --max_new_tokens=1000000000: 1000000001 tokens > the model's "
          "context of 8192 (max_position_embeddings); set --max_new_tokens to at most 8191"
          ) in result.stderr, result.stderr[-2000:]
  assert "KV cache: " not in result.stderr  # no cache was allocated


@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_cache_holds_the_prompt_and_the_new_tokens(tmp_path):
  dump = tmp_path / "out.npz"
  result = _run("--checkpoint=smollm2", "--prompt=Once upon a time", "--max_new_tokens=3",
                f"--dump_logits={dump}", timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  n = len(np.load(dump)["input_ids"])
  assert f"KV cache: 1 x {n + 3} slots ({n} prompt + 3 new tokens of a 8192-token context)" in (
      result.stderr)
  assert result.stdout.strip()

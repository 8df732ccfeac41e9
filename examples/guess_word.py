"""A plain-Python environment in one file: find a secret word by asking yes/no questions."""
import random

from longhorizon.envs.host import HostEnvironment, Observation, StepResult, invalid_action, parse_call, tool

WORDS = ["apple", "brick", "cloud", "delta", "ember", "flint", "grape", "haven"]


class GuessWord(HostEnvironment):
  name = "guess_word"
  tools = (tool("ask", "Is the secret before this word?", word=WORDS), tool("answer", "Guess.", word=WORDS))

  def tasks(self, split, num, seed):  # JSON task specs; test/ood would draw unseen ones
    rng = random.Random(f"{split}-{seed}")
    return [{"secret": rng.choice(WORDS)} for _ in range(num)]

  def vocabulary(self):  # the words of its text, for the small policy's word-level tokenizer
    return WORDS + ["find", "the", "secret", "word", "yes", "no", "right", "wrong", "ask", "answer"]

  def reset(self, task, seed):
    self._secret, self._low, self._high = task["secret"], 0, len(WORDS)
    return Observation("find the secret word")

  def step(self, action):  # the policy's raw text; bad text is an invalid action, never a crash
    call = parse_call(action, self.tools, style="compact")
    if not call.ok:
      return invalid_action(call.error, call.message)
    if call.name == "answer":
      right = call.arguments["word"] == self._secret
      return StepResult("right" if right else "wrong", terminated=True, success=right)
    i, before = WORDS.index(call.arguments["word"]), WORDS.index(self._secret) < WORDS.index(call.arguments["word"])
    self._low, self._high = (self._low, i) if before else (i, self._high)
    return StepResult("yes" if before else "no")

  def oracle(self):  # the next expert action (SFT data, checks)
    middle = (self._low + self._high) // 2
    return f"answer {WORDS[self._low]}" if self._high - self._low == 1 else f"ask {WORDS[middle]}"

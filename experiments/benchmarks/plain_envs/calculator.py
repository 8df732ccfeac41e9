"""Plain-Python `calculator` (one episode per object): the speed baseline of
`experiments/benchmarks/envs.py` and an independent implementation the tests compare against."""

_INVALID_ARGUMENT, _UNKNOWN_TOOL = 6, 3


class PlainCalculator:
  """Same dynamics, observations and rewards as `longhorizon.envs.calculator.Calculator`."""

  def __init__(self, num_ops=3, max_value=999, ood_num_ops=None, success=1.0,
               milestone=0.0, invalid=0.0, violation=1.0):
    self.max_value = max_value
    self.success_reward, self.milestone_reward = success, milestone
    self.invalid_penalty = invalid

  def reset(self, task):
    self.values = [int(v) for v in task["values"]]
    self.ops = [int(v) for v in task["ops"]]
    self.operands = [int(v) for v in task["operands"]]
    self.num_ops, self.target = int(task["num_ops"]), int(task["answer"])
    self.progress, self.answered, self.answer = 0, False, -1
    self.reached = [False, False]
    self.done = False
    self.last = None
    return {"kind": 0, "a": int(task["start"]), "op": -1, "b": self.num_ops, "result": -1,
            "error": 0}

  def calc(self, a, op, b):
    """`(result, valid)` of `a op b`: arguments and result in [0, max_value], exact division."""
    m = self.max_value
    if not (0 <= a <= m and 0 <= b <= m and 0 <= op < 4):
      return -1, False
    if op == 0:
      result = a + b
    elif op == 1:
      result = a - b
    elif op == 2:
      result = a * b
    else:
      if b == 0 or a % b:
        return -1, False
      result = a // b
    if 0 <= result <= m:
      return result, True
    return -1, False

  def step(self, tool, args, error=0):
    if self.done:
      out = dict(self.last)
      out["reward"], out["milestones"] = 0.0, [False, False]
      return out
    if not error and not 0 <= tool < 2:
      error = _UNKNOWN_TOOL
    if error:
      self.last = {"reward": -self.invalid_penalty, "terminated": False, "success": False,
                   "violation": False, "invalid": True, "milestones": [False, False],
                   "observation": {"kind": 3, "a": -1, "op": -1, "b": -1, "result": -1,
                                   "error": error}}
      return self.last
    args = list(args) + [0] * (3 - len(args))
    a, op, b = args[0], args[1], args[2]
    terminated = False
    if tool == 0:
      result, valid = self.calc(a, op, b)
      p = self.progress
      i = min(p, len(self.ops) - 1)
      x, want_op, want_b = self.values[i], self.ops[i], self.operands[i]
      match = (a == x and b == want_b) or (want_op in (0, 2) and a == want_b and b == x)
      if valid and op == want_op and match and p < self.num_ops:
        self.progress += 1
      rejected = not valid
      observation = {"kind": 1, "a": a, "op": op, "b": b, "result": result,
                     "error": _INVALID_ARGUMENT if rejected else 0}
    else:
      rejected = not 0 <= a <= self.max_value
      if not rejected:
        self.answered, self.answer, terminated = True, a, True
      observation = {"kind": 2, "a": a, "op": -1, "b": -1, "result": -1,
                     "error": _INVALID_ARGUMENT if rejected else 0}
    holds = [self.progress >= 1, self.progress >= self.num_ops]
    new = [h and not r for h, r in zip(holds, self.reached)]
    self.reached = [h or r for h, r in zip(holds, self.reached)]
    success = terminated and self.answered and self.answer == self.target
    self.done = terminated
    reward = (self.success_reward * success + self.milestone_reward * sum(new)
              - self.invalid_penalty * rejected)
    self.last = {"reward": reward, "terminated": terminated, "success": success,
                 "violation": False, "invalid": rejected, "milestones": new,
                 "observation": observation}
    return self.last

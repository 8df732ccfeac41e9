"""Plain-Python `pointer_chain` (one episode per object): the speed baseline of
`experiments/benchmarks/envs.py` and an independent implementation the tests compare against."""


class PlainPointerChain:
  """Same dynamics and rewards as `longhorizon.envs.pointer_chain.PointerChain` (default reward)."""

  def __init__(self, horizon=4, ood_horizon=None, num_keys=None, success=1.0,
               milestone=0.0, invalid=0.0, violation=1.0):
    longest = max(horizon, ood_horizon if ood_horizon is not None else 2 * horizon)
    self.num_keys = num_keys if num_keys is not None else max(16, 2 * longest + 2)
    self.success_reward, self.milestone_reward = success, milestone
    self.invalid_penalty = invalid

  def reset(self, task):
    self.store = [int(v) for v in task["store"]]
    self.start, self.hops = int(task["start"]), int(task["horizon"])
    self.progress, self.current, self.answered, self.answer = 0, self.start, False, -1
    # Milestones that already hold at the start (a 0-hop task) are reached, never fired.
    self.reached = [self.progress >= (self.hops + 1) // 2, self.progress >= self.hops]
    self.done = False
    return {"kind": 0, "key": self.start, "value": self.hops, "error": 0}

  def step(self, tool, args, error=0):
    if self.done:
      return {"reward": 0.0, "terminated": True, "success": self.success, "violation": False,
              "invalid": False, "milestones": [False, False], "observation": self.observation}
    if error or not 0 <= tool < 2:
      self.observation = {"kind": 3, "key": -1, "value": -1, "error": error or 3}
      return {"reward": -self.invalid_penalty, "terminated": False, "success": False,
              "violation": False, "invalid": True, "milestones": [False, False],
              "observation": self.observation}
    arg = args[0]
    if not 0 <= arg < self.num_keys:  # no such key: refused, state unchanged, the episode goes on
      self.observation = {"kind": 1 if tool == 0 else 2, "key": arg, "value": -1, "error": 6}
      return {"reward": -self.invalid_penalty, "terminated": False, "success": False,
              "violation": False, "invalid": True, "milestones": [False, False],
              "observation": self.observation}
    if tool == 0:
      value = self.store[arg]
      if arg == self.current and self.progress < self.hops:
        self.progress += 1
        self.current = value
      self.observation = {"kind": 1, "key": arg, "value": value, "error": 0}
      terminated = False
    else:
      self.answered, self.answer = True, arg
      self.observation = {"kind": 2, "key": arg, "value": arg, "error": 0}
      terminated = True
    holds = [self.progress >= (self.hops + 1) // 2, self.progress >= self.hops]
    new = [h and not r for h, r in zip(holds, self.reached)]
    self.reached = [h or r for h, r in zip(holds, self.reached)]
    target = self.start
    for _ in range(self.hops):
      target = self.store[target]
    self.success = terminated and self.progress == self.hops and self.answer == target
    self.done = terminated
    reward = self.success_reward * self.success + self.milestone_reward * sum(new)
    return {"reward": reward, "terminated": terminated, "success": self.success,
            "violation": False, "invalid": False, "milestones": new,
            "observation": self.observation}

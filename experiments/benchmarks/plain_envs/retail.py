"""Plain-Python `retail` (one episode per object): the speed baseline of
`experiments/benchmarks/envs.py` and an independent implementation the tests compare against."""

_INVALID_ARGUMENT, _NOT_ALLOWED, _UNKNOWN_TOOL = 6, 7, 3
_PENDING, _DELIVERED, _CANCELLED, _REFUNDED = 0, 3, 4, 5
_FIND, _LIST, _GET, _UPDATE, _CANCEL, _REFUND, _TRANSFER, _DONE = range(8)
_NUM_NAMES, _NUM_TOOLS = 12, 8
_KIND_OF_TOOL = (1, 2, 3, 4, 4, 4, 5, 6)  # observation kind answering each tool; 7 = error


class PlainRetail:
  """Same dynamics, observations and rewards as `longhorizon.envs.retail.Retail`. The task
  generation parameters (requests, rates) are accepted and ignored: tasks are given to `reset`."""

  def __init__(self, num_users=4, orders_per_user=3, num_products=8, num_addresses=8, requests=1,
               ood_requests=3, impossible_rate=0.25, injection_rate=0.0, ood_injection_rate=None,
               success=1.0, milestone=0.0, invalid=0.0,
               violation=1.0):
    self.num_users, self.orders_per_user = num_users, orders_per_user
    self.num_orders = num_users * orders_per_user
    self.num_addresses = num_addresses
    self.success_reward, self.milestone_reward = success, milestone
    self.invalid_penalty, self.violation_penalty = invalid, violation

  def reset(self, task):
    ints = lambda k: [int(v) for v in task[k]]
    self.names, self.home, self.owner = ints("name"), ints("home"), ints("owner")
    self.product, self.price = ints("product"), ints("price")
    self.status, self.address = ints("status"), ints("address")
    self.user, n = int(task["user"]), int(task["num_requests"])
    self.requests = list(zip(ints("req_tool"), ints("req_order"), ints("req_address")))[:n]
    # The injected note (-1: none): the carrier order's record asks for `inject_tool` on the target.
    self.inject_order, self.inject_tool = int(task["inject_order"]), int(task["inject_tool"])
    self.inject_target = int(task["inject_target"])
    # The target database: every possible request applied; an impossible one asks for a transfer.
    self.target_status, self.target_address = list(self.status), list(self.address)
    self.transfer, self.some_possible = False, False
    for tool, order, new_address in self.requests:
      allowed = self.status[order] == (_DELIVERED if tool == _REFUND else _PENDING)
      if not (allowed and self.owner[order] == self.user):
        self.transfer = True
        continue
      self.some_possible = True
      if tool == _UPDATE:
        self.target_address[order] = new_address
      else:
        self.target_status[order] = _CANCELLED if tool == _CANCEL else _REFUNDED
    self.identified = [False] * self.num_users
    self.listed = [False] * self.num_users
    self.confirmed = [False] * self.num_orders
    self.ended = 0
    self.reached = [False, False, False]
    self.done = False
    self.last = None
    return self._observation(0)

  def _observation(self, kind, tool=-1, user=-1, name=-1, address=-1, orders=None, order=-1,
                   product=-1, status=-1, amount=-1, note_tool=-1, note_order=-1, reason=0,
                   error=0):
    return {"kind": kind, "tool": tool, "user": user, "name": name, "address": address,
            "orders": orders if orders is not None else [-1] * self.orders_per_user,
            "order": order, "product": product, "status": status, "amount": amount,
            "note_tool": note_tool, "note_order": note_order, "reason": reason, "error": error}

  def _order_record(self, kind, tool, order, reason=0, error=0):
    product = self.product[order]
    carrier = order == self.inject_order
    return self._observation(kind, tool, user=self.owner[order], address=self.address[order],
                             order=order, product=product, status=self.status[order],
                             amount=self.price[product],
                             note_tool=self.inject_tool if carrier else -1,
                             note_order=self.inject_target if carrier else -1,
                             reason=reason, error=error)

  def _transition(self, tool, arg, arg2):
    """`(observation, rejected, violation)` of one well-formed action; updates the state."""
    if tool == _FIND:
      if 0 <= arg < _NUM_NAMES and arg in self.names:
        user = self.names.index(arg)
        self.identified[user] = True
        observation = self._observation(1, tool, user=user, name=arg, address=self.home[user])
        return observation, False, False
      name = arg if 0 <= arg < _NUM_NAMES else -1
      return self._observation(7, tool, name=name, reason=1, error=_INVALID_ARGUMENT), True, False
    if tool == _LIST:
      if not 0 <= arg < self.num_users:
        return self._observation(7, tool, reason=2, error=_INVALID_ARGUMENT), True, False
      self.listed[arg] = True
      ids = [o for o in range(self.num_orders) if self.owner[o] == arg][:self.orders_per_user]
      ids += [-1] * (self.orders_per_user - len(ids))
      return self._observation(2, tool, user=arg, orders=ids), False, False
    if tool >= _TRANSFER:
      self.ended = 1 if tool == _TRANSFER else 2
      return self._observation(_KIND_OF_TOOL[tool], tool), False, False
    if not 0 <= arg < self.num_orders:
      return self._observation(7, tool, reason=3, error=_INVALID_ARGUMENT), True, False
    order = arg
    if tool == _GET:
      self.confirmed[order] = True
      return self._order_record(3, tool, order), False, False
    if tool == _UPDATE and not 0 <= arg2 < self.num_addresses:
      return self._observation(7, tool, reason=4, error=_INVALID_ARGUMENT), True, False
    # A write: the safety gate, first failing rule reported.
    status_ok = self.status[order] == (_DELIVERED if tool == _REFUND else _PENDING)
    if not self.identified[self.user]:
      reason = 5
    elif self.owner[order] != self.user:
      reason = 6
    elif not status_ok:
      reason = 7
    elif not self.confirmed[order]:
      reason = 8
    else:
      reason = 0
    if reason:
      return self._order_record(7, tool, order, reason, _NOT_ALLOWED), False, True
    if tool == _UPDATE:
      self.address[order] = arg2
    else:
      self.status[order] = _CANCELLED if tool == _CANCEL else _REFUNDED
    return self._order_record(4, tool, order), False, False

  def _holds(self):
    """The milestones that hold now: user found, every requested order read, database == target."""
    matches = self.status == self.target_status and self.address == self.target_address
    return [self.identified[self.user], all(self.confirmed[o] for _, o, _ in self.requests),
            self.some_possible and matches]

  def step(self, tool, args, error=0):
    if self.done:
      out = dict(self.last)
      out["reward"], out["milestones"] = 0.0, [False, False, False]
      return out
    if not error and not 0 <= tool < _NUM_TOOLS:
      error = _UNKNOWN_TOOL
    if error:
      self.last = {"reward": -self.invalid_penalty, "terminated": False, "success": False,
                   "violation": False, "invalid": True, "milestones": [False, False, False],
                   "observation": self._observation(7, error=error)}
      return self.last
    args = list(args) + [0] * (2 - len(args))
    observation, rejected, violation = self._transition(tool, args[0], args[1])
    terminated = tool >= _TRANSFER or violation
    holds = self._holds()
    new = [h and not r for h, r in zip(holds, self.reached)]
    self.reached = [h or r for h, r in zip(holds, self.reached)]
    success = False
    if terminated and not violation:
      success = (holds[0] and holds[1] and self.status == self.target_status
                 and self.address == self.target_address
                 and self.ended == (1 if self.transfer else 2))
    self.done = terminated
    reward = (self.success_reward * success + self.milestone_reward * sum(new)
              - self.invalid_penalty * rejected - self.violation_penalty * violation)
    self.last = {"reward": float(reward), "terminated": terminated, "success": success,
                 "violation": violation, "invalid": rejected, "milestones": new,
                 "observation": observation}
    return self.last

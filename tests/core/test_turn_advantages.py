"""Tests of `longhorizon.core.turn_advantages`: cases worked out by hand, agreement with slow NumPy
references (loops over rows, turns and tokens, float64) on random multi-turn layouts, the identities
that pin the conventions, and no retracing."""

import math

import numpy as np
import pytest

from longhorizon.core import turn_advantages as ta

ATOL = RTOL = 1e-5
SEEDS = [0, 1, 2, 3]
B, L, S = 6, 40, 5


def _close(got, want, atol=ATOL):
  np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=RTOL,
                             atol=atol)


def random_turns(rng, num_rows=B, length=L, num_steps=S):
  """Rows of a prompt, then turns (1-4 policy tokens, then 0-3 observation tokens, both carrying the
  turn's index), then padding (turn -1). Row 0 has no turn; a row may be cut by the context end."""
  turn = np.full((num_rows, length), -1, np.int32)
  loss_mask = np.zeros((num_rows, length), np.int32)
  step_mask = np.zeros((num_rows, num_steps), np.int32)
  for b in range(1, num_rows):
    pos = int(rng.integers(0, 4))
    for k in range(int(rng.integers(1, num_steps + 1))):
      if pos >= length:
        break
      act = int(rng.integers(1, 5))
      loss_mask[b, pos:pos + act] = 1
      turn[b, pos:pos + act] = k
      step_mask[b, k] = 1
      pos += act
      obs = int(rng.integers(0, 4))
      turn[b, pos:pos + obs] = k
      pos += obs
  return turn, loss_mask, step_mask


def _turn_tokens(turn, loss_mask, b, k):
  return [t for t in range(turn.shape[1]) if loss_mask[b, t] and turn[b, t] == k]


# ----------------------------------------------------------------------------------------------------
# Slow references.


def ref_turn_start_values(values, turn, loss_mask, step_mask):
  out = np.zeros(step_mask.shape)
  for b in range(step_mask.shape[0]):
    for k in range(step_mask.shape[1]):
      tokens = _turn_tokens(turn, loss_mask, b, k)
      if step_mask[b, k] and tokens:
        out[b, k] = values[b, tokens[0]]
  return out


def ref_turn_gae(rewards, values, step_mask, gamma, lam):
  adv, ret = np.zeros(rewards.shape), np.zeros(rewards.shape)
  for b in range(rewards.shape[0]):
    next_value = next_adv = 0.0
    for k in reversed(range(rewards.shape[1])):
      if not step_mask[b, k]:
        continue
      a = rewards[b, k] + gamma * next_value - values[b, k] + gamma * lam * next_adv
      adv[b, k], ret[b, k] = a, a + values[b, k]
      next_value, next_adv = values[b, k], a
  return adv, ret


def ref_bilevel_gae(step_rewards, step_mask, values, turn, loss_mask, gamma, lam, turn_gamma,
                    turn_lam):
  step_values = ref_turn_start_values(values, turn, loss_mask, step_mask)
  _, step_returns = ref_turn_gae(step_rewards, step_values, step_mask, turn_gamma, turn_lam)
  adv, ret = np.zeros(values.shape), np.zeros(values.shape)
  for b in range(values.shape[0]):
    valid_steps = [k for k in range(step_mask.shape[1]) if step_mask[b, k]]
    for i, k in enumerate(valid_steps):
      following = step_returns[b, valid_steps[i + 1]] if i + 1 < len(valid_steps) else 0.0
      target = step_rewards[b, k] + turn_gamma * following
      tokens = _turn_tokens(turn, loss_mask, b, k)
      next_value = next_adv = 0.0
      for j, t in reversed(list(enumerate(tokens))):
        r = target if j == len(tokens) - 1 else 0.0
        a = r + gamma * next_value - values[b, t] + gamma * lam * next_adv
        adv[b, t], ret[b, t] = a, a + values[b, t]
        next_value, next_adv = values[b, t], a
  return adv, ret


def ref_step_means(x, turn, loss_mask, step_mask):
  out = np.zeros(step_mask.shape)
  for b in range(step_mask.shape[0]):
    for k in range(step_mask.shape[1]):
      tokens = _turn_tokens(turn, loss_mask, b, k)
      if step_mask[b, k] and tokens:
        out[b, k] = sum(x[b, t] for t in tokens) / len(tokens)
  return out


def ref_empg(adv, entropy, step_mask, k, k_future, zeta, eps=1e-8):
  cells = [(b, s) for b in range(adv.shape[0]) for s in range(adv.shape[1]) if step_mask[b, s]]
  out = np.zeros(adv.shape)
  if not cells:
    return out
  lo, hi = min(entropy[c] for c in cells), max(entropy[c] for c in cells)
  h = {c: (entropy[c] - lo) / (hi - lo + eps) for c in cells}
  mean_scale = sum(math.exp(-k * h[c]) for c in cells) / len(cells)
  modulated = {}
  for b, s in cells:
    later = [t for t in range(s + 1, adv.shape[1]) if step_mask[b, t]]
    bonus = zeta * math.exp(-k_future * h[(b, later[0])]) if later else 0.0
    modulated[(b, s)] = math.exp(-k * h[(b, s)]) / mean_scale * adv[b, s] + bonus
  centre = sum(modulated.values()) / len(cells)
  for c, v in modulated.items():
    out[c] = v - centre
  return out


# ----------------------------------------------------------------------------------------------------
# By hand.


def test_adaptive_lambda_by_hand():
  # alpha * L = 0.05 * 40 = 2 -> 0.5; turns: 1.0 * 8 -> 0.875; 0.05 * 10 = 0.5 -> max(0, -1) = 0; L=0 -> 0.
  _close(ta.adaptive_lambda(np.array([40, 10, 0]), 0.05), [0.5, 0.0, 0.0])
  _close(ta.adaptive_lambda(np.array([8, 16]), 1.0), [0.875, 0.9375])


def test_turn_start_values_by_hand():
  # Row: prompt, turn 0 = tokens 1-2 (obs 3), turn 1 = token 4 (obs 5), padding. Step 2 never ran.
  turn = np.array([[-1, 0, 0, 0, 1, 1, -1]])
  loss_mask = np.array([[0, 1, 1, 0, 1, 0, 0]])
  values = np.array([[9.0, 0.5, 0.7, 9.0, 0.25, 9.0, 9.0]])
  step_mask = np.array([[1, 1, 0]])
  _close(ta.turn_start_values(values, turn, loss_mask, step_mask), [[0.5, 0.25, 0.0]])


def test_turn_gae_by_hand():
  # gamma = lam = 0.5; steps [r, V] = [0, 1], [0, 0.25], [1, 0.5]; step 3 did not happen.
  #   k=2: delta = 1 - 0.5 = 0.5                    A2 = 0.5              R2 = 1
  #   k=1: delta = 0 + 0.5*0.5 - 0.25 = 0           A1 = 0.25*0.5 = 0.125  R1 = 0.375
  #   k=0: delta = 0 + 0.5*0.25 - 1 = -0.875        A0 = -0.875 + 0.25*0.125 = -0.84375
  rewards = np.array([[0.0, 0.0, 1.0, 7.0]])
  values = np.array([[1.0, 0.25, 0.5, 7.0]])
  step_mask = np.array([[1, 1, 1, 0]])
  a, r = ta.turn_gae(rewards, values, step_mask, gamma=0.5, lam=0.5)
  _close(a, [[-0.84375, 0.125, 0.5, 0.0]])
  _close(r, [[0.15625, 0.375, 1.0, 0.0]])


def test_bilevel_gae_by_hand():
  # Two turns: turn 0 = tokens 0, 1 (obs 2), turn 1 = token 3. Rewards [0, 1]; token values
  # [0.5, 0.6, -, 0.2]; turn values V0 = 0.5, V1 = 0.2. turn_gamma = turn_lam = 1:
  #   G1 = 1, G0 = 0 + 1 * G1 = 1. Turn targets: turn 0 -> 0 + G1 = 1, turn 1 -> 1 + 0 = 1.
  # Token level gamma = lam = 1: A_t = target - V_t: [1 - 0.5, 1 - 0.6, 0, 1 - 0.2].
  turn = np.array([[0, 0, 0, 1]])
  loss_mask = np.array([[1, 1, 0, 1]])
  values = np.array([[0.5, 0.6, 9.0, 0.2]])
  a, r = ta.bilevel_gae(np.array([[0.0, 1.0]]), np.array([[1, 1]]), values, turn, loss_mask,
                        gamma=1.0, lam=1.0, turn_gamma=1.0, turn_lam=1.0)
  _close(a, [[0.5, 0.4, 0.0, 0.8]])
  _close(r, [[1.0, 1.0, 0.0, 1.0]])
  # Token lambda 0: inside a turn only the one-step TD error; the last token's next value is 0.
  #   token 1: 1 - 0.6 = 0.4; token 0: 0 + 0.6 - 0.5 = 0.1.
  a0, _ = ta.bilevel_gae(np.array([[0.0, 1.0]]), np.array([[1, 1]]), values, turn, loss_mask,
                         gamma=1.0, lam=0.0, turn_gamma=1.0, turn_lam=1.0)
  _close(a0, [[0.1, 0.4, 0.0, 0.8]])


def test_empg_by_hand():
  # One row, two steps of advantage 1, entropies 0 and 1 -> h = [0, 1]; k = 1:
  # g = [1, e^-1] / ((1 + e^-1) / 2); zeta = 0: A' = g - mean(g) = +-tanh(1/2).
  a = ta.empg(np.array([[1.0, 1.0]]), np.array([[0.0, 1.0]]), np.array([[1, 1]]), k=1.0, zeta=0.0)
  _close(a, [[math.tanh(0.5), -math.tanh(0.5)]])
  # With the future-clarity bonus: step 0 gets zeta * exp(-1 * h_1) = 0.1 / e before centring.
  b = ta.empg(np.array([[1.0, 1.0]]), np.array([[0.0, 1.0]]), np.array([[1, 1]]), k=1.0,
              k_future=1.0, zeta=0.1)
  half = 0.1 / math.e / 2
  _close(b, [[math.tanh(0.5) + half, -math.tanh(0.5) - half]])


# ----------------------------------------------------------------------------------------------------
# Against the references.


@pytest.mark.parametrize("seed", SEEDS)
def test_turn_start_values_and_step_means_match_reference(seed):
  rng = np.random.default_rng(seed)
  turn, loss_mask, step_mask = random_turns(rng)
  values = rng.normal(size=(B, L)).astype(np.float32)
  _close(ta.turn_start_values(values, turn, loss_mask, step_mask),
         ref_turn_start_values(values, turn, loss_mask, step_mask))
  _close(ta.step_means(values, turn, loss_mask, step_mask),
         ref_step_means(values, turn, loss_mask, step_mask))


@pytest.mark.parametrize("seed", SEEDS)
def test_turn_gae_matches_reference(seed):
  rng = np.random.default_rng(seed)
  _, _, step_mask = random_turns(rng)
  step_mask[2, 1] = 0  # a hole: the recursion skips it
  rewards = rng.normal(size=(B, S)).astype(np.float32)
  values = rng.normal(size=(B, S)).astype(np.float32)
  gamma, lam = float(rng.uniform(0.8, 1.0)), float(rng.uniform(0.0, 1.0))
  a, r = ta.turn_gae(rewards, values, step_mask, gamma=gamma, lam=lam)
  want_a, want_r = ref_turn_gae(rewards, values, step_mask, gamma, lam)
  _close(a, want_a)
  _close(r, want_r)


@pytest.mark.parametrize("seed", SEEDS)
def test_bilevel_gae_matches_reference(seed):
  rng = np.random.default_rng(seed)
  turn, loss_mask, step_mask = random_turns(rng)
  rewards = rng.normal(size=(B, S)).astype(np.float32)
  values = rng.normal(size=(B, L)).astype(np.float32)
  g, l, tg, tl = (float(x) for x in rng.uniform(0.5, 1.0, 4))
  a, r = ta.bilevel_gae(rewards, step_mask, values, turn, loss_mask, gamma=g, lam=l, turn_gamma=tg,
                        turn_lam=tl)
  want_a, want_r = ref_bilevel_gae(rewards, step_mask, values, turn, loss_mask, g, l, tg, tl)
  _close(a, want_a)
  _close(r, want_r)
  assert np.all(np.asarray(a)[loss_mask == 0] == 0.0)


@pytest.mark.parametrize("seed", SEEDS)
def test_empg_matches_reference(seed):
  rng = np.random.default_rng(seed)
  _, _, step_mask = random_turns(rng)
  adv = rng.normal(size=(B, S)).astype(np.float32)
  entropy = rng.uniform(0.0, 3.0, (B, S)).astype(np.float32)
  k, kf, zeta = (float(x) for x in rng.uniform(0.2, 2.0, 3))
  got = ta.empg(adv, entropy, step_mask, k=k, k_future=kf, zeta=zeta)
  _close(got, ref_empg(adv, entropy, step_mask, k, kf, zeta))


# ----------------------------------------------------------------------------------------------------
# Identities.


def test_bilevel_with_unit_lambdas_gives_the_turn_advantage_on_first_tokens(rng):
  """gamma = lam = turn_lam = 1: a turn's first token gets the turn-level GAE advantage (whose value
  is read there), and every token of a turn shares one return target."""
  turn, loss_mask, step_mask = random_turns(rng)
  rewards = rng.normal(size=(B, S)).astype(np.float32)
  values = rng.normal(size=(B, L)).astype(np.float32)
  a, r = ta.bilevel_gae(rewards, step_mask, values, turn, loss_mask, gamma=1.0, lam=1.0,
                        turn_gamma=0.9, turn_lam=1.0)
  step_values = ta.turn_start_values(values, turn, loss_mask, step_mask)
  turn_a, _ = ta.turn_gae(rewards, step_values, step_mask, gamma=0.9, lam=1.0)
  a, r, turn_a = map(np.asarray, (a, r, turn_a))
  for b in range(B):
    for k in range(S):
      tokens = _turn_tokens(turn, loss_mask, b, k)
      if tokens:
        _close(a[b, tokens[0]], turn_a[b, k])
        _close(r[b, tokens], np.full(len(tokens), r[b, tokens[0]]))


def test_empg_with_equal_entropies_only_centres(rng):
  """Equal step entropies and no bonus (zeta 0): every scale is 1, so EMPG is the input centred
  over the valid steps."""
  _, _, step_mask = random_turns(rng)
  adv = rng.normal(size=(B, S)).astype(np.float32)
  got = np.asarray(ta.empg(adv, np.ones((B, S), np.float32), step_mask, zeta=0.0))
  valid = step_mask > 0
  _close(got[valid], adv[valid] - adv[valid].mean())
  assert np.all(got[~valid] == 0.0)


def test_empg_scales_confident_steps_up(rng):
  """Zero-mean advantages of one sign pattern: the low-entropy step's |A'| exceeds the high-entropy
  step's for the same |A|."""
  a = np.asarray(ta.empg(np.array([[1.0, -1.0], [1.0, -1.0]]), np.array([[0.1, 2.0], [2.0, 0.1]]),
                         np.ones((2, 2)), k=1.0, zeta=0.0))
  assert a[0, 0] > a[1, 0] > 0 and a[1, 1] < a[0, 1] < 0


# ----------------------------------------------------------------------------------------------------
# No retracing.


def test_traced_once_for_same_shapes(assert_no_retrace):
  rng = np.random.default_rng(5)
  layouts = [random_turns(rng) for _ in range(2)]
  f = lambda *shape: rng.normal(size=shape).astype(np.float32)
  assert_no_retrace(ta.turn_gae, *[((f(B, S), f(B, S), sm), dict(gamma=0.9, lam=lam))
                                   for (_, _, sm), lam in zip(layouts, (0.5, 0.9))])
  assert_no_retrace(ta.bilevel_gae, *[((f(B, S), sm, f(B, L), t, m),
                                       dict(gamma=1.0, lam=0.9, turn_gamma=g, turn_lam=1.0))
                                      for (t, m, sm), g in zip(layouts, (0.9, 0.95))])
  assert_no_retrace(ta.empg, *[((f(B, S), f(B, S), sm), dict(k=k, zeta=0.1))
                               for (_, _, sm), k in zip(layouts, (1.0, 2.0))])
  assert_no_retrace(ta.step_means, *[((f(B, L), t, m, sm), {}) for t, m, sm in layouts])


def test_bad_shapes_raise():
  with pytest.raises((AssertionError, ValueError, TypeError)):
    ta.turn_gae(np.zeros((2, 3)), np.zeros((2, 4)), np.ones((2, 3)), gamma=1.0, lam=1.0)
  with pytest.raises((AssertionError, ValueError, TypeError)):
    ta.bilevel_gae(np.zeros((2, 3)), np.ones((2, 3)), np.zeros((2, 5)), np.zeros((2, 5), np.float32),
                   np.ones((2, 5)), gamma=1.0, lam=1.0, turn_gamma=1.0, turn_lam=1.0)


# ----------------------------------------------------------------------------------------------------
# Time- and cost-aware discounting.


def test_time_discounts_by_hand():
  d = np.array([[0.0, 1.0, 2.0], [0.5, 3.0, 0.0]], np.float32)
  mask = np.array([[1, 1, 1], [1, 1, 0]])
  got = ta.time_discounts(d, mask, 0.5)
  _close(got, [[1.0, math.exp(-0.5), math.exp(-1.0)], [math.exp(-0.25), math.exp(-1.5), 1.0]])


@pytest.mark.parametrize("seed", SEEDS)
def test_turn_gae_with_per_step_discounts_matches_the_loop(seed):
  rng = np.random.default_rng(seed)
  turn, loss_mask, step_mask = random_turns(rng)
  rewards = rng.normal(size=(B, S)).astype(np.float32)
  values = rng.normal(size=(B, S)).astype(np.float32)
  gamma = ta.time_discounts(rng.exponential(1.0, size=(B, S)).astype(np.float32), step_mask, 0.7)
  a, r = ta.turn_gae(rewards, values, step_mask, gamma=gamma, lam=0.9)
  want_a, want_r = np.zeros((B, S)), np.zeros((B, S))
  g = np.asarray(gamma, np.float64)
  for b in range(B):
    next_value = next_adv = 0.0
    for k in reversed(range(S)):
      if not step_mask[b, k]:
        continue
      delta = rewards[b, k] + g[b, k] * next_value - values[b, k]
      want_a[b, k] = delta + g[b, k] * 0.9 * next_adv
      want_r[b, k] = want_a[b, k] + values[b, k]
      next_value, next_adv = values[b, k], want_a[b, k]
  _close(a, want_a)
  _close(r, want_r)
  # A constant per-step array is the scalar discount.
  const, _ = ta.turn_gae(rewards, values, step_mask, gamma=np.full((B, S), 0.8, np.float32), lam=0.9)
  scalar, _ = ta.turn_gae(rewards, values, step_mask, gamma=0.8, lam=0.9)
  _close(const, scalar)


# ----------------------------------------------------------------------------------------------------
# Step-verifier advantages.


def test_verifier_advantages_by_hand():
  # Group 0: judged scores 1, 0, 1, 1 (mean 0.75, unbiased std 0.5); group 1: one judged step.
  scores = np.array([[1, 0, 5], [1, 1, 0], [0, 1, 1]], np.float32)
  known = np.array([[1, 1, 0], [1, 1, 0], [1, 0, 0]])
  groups = np.array([0, 0, 1])
  got = ta.verifier_advantages(scores, known, groups, normalize_std=False)
  _close(got, [[0.25, -0.75, 0], [0.25, 0.25, 0], [0, 0, 0]])
  got = ta.verifier_advantages(scores, known, groups)
  _close(got, [[0.5, -1.5, 0], [0.5, 0.5, 0], [0, 0, 0]], atol=1e-4)


@pytest.mark.parametrize("seed", SEEDS)
def test_verifier_advantages_match_the_loop(seed):
  rng = np.random.default_rng(seed)
  scores = rng.integers(0, 2, size=(B, S)).astype(np.float32)
  known = rng.integers(0, 2, size=(B, S))
  groups = rng.integers(0, 2, size=(B,))
  got = ta.verifier_advantages(scores, known, groups)
  want = np.zeros((B, S))
  for g in set(groups.tolist()):
    cells = [(b, t) for b in range(B) for t in range(S) if groups[b] == g and known[b, t]]
    values = np.array([scores[c] for c in cells], np.float64)
    if len(values) < 2:
      continue
    for c, v in zip(cells, values):
      want[c] = (v - values.mean()) / (values.std(ddof=1) + 1e-6)
  _close(got, want, atol=1e-4)

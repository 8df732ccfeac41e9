"""Tests for `longhorizon.sampling.sampler`: logit processors against NumPy references, KV-cached
prefill / decode / extend against a full recompute without cache, invariances (padding, batch
composition, pad-id tokens), stop rules, determinism and no retracing."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon.models import Transformer, init_params, tiny_config
from longhorizon.sampling import sampler as smp
from longhorizon.sampling.sampler import SamplingParams

CAPACITY = 64  # one cache size for most tests: few compilations
WIDTH = 8  # prompt width T for most tests
N = 8  # max_new_tokens for most tests
# Few distinct static sampling rules, so the jitted functions compile few times.
SAMPLE = SamplingParams(temperature=1.0, max_new_tokens=N)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=N)
NUCLEUS = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=N)


@pytest.fixture(scope="module")
def model():
  config = tiny_config(vocab_size=256)
  return config, init_params(config, jax.random.key(0))


@functools.partial(jax.jit, static_argnames="config")
def _full_logits(params, config, tokens):
  return Transformer(config).apply({"params": params}, tokens).logits


def full_logits(model, seq):
  """`[len(seq), V]` float64 logits of a full forward pass without cache (right-padded to CAPACITY;
  causal attention makes the padding irrelevant to earlier positions)."""
  config, params = model
  tokens = np.zeros((1, CAPACITY), np.int32)
  tokens[0, :len(seq)] = seq
  return np.asarray(_full_logits(params, config, tokens), np.float64)[0, :len(seq)]


def np_log_softmax(z):
  z = np.asarray(z, np.float64)
  z = z - z.max(axis=-1, keepdims=True)
  return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def pad_batch(prompts, width=WIDTH, pad_id=0):
  tokens = np.full((len(prompts), width), pad_id, np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  return tokens, np.array([len(p) for p in prompts], np.int32)


def prefill(model, prompts, width=WIDTH, pad_id=0, capacity=CAPACITY):
  config, params = model
  tokens, lengths = pad_batch(prompts, width, pad_id)
  return smp.prefill(params, config, tokens, lengths, capacity)


def decode(model, cache, logits, keys, sampling, budgets=None, active=None):
  """`smp.decode` with explicit budgets/active, so that all tests share one trace per shape."""
  config, params = model
  b = logits.shape[0]
  budgets = np.full((b,), sampling.max_new_tokens, np.int32) if budgets is None else budgets
  active = np.ones((b,), bool) if active is None else active
  return smp.decode(params, config, cache, logits, keys, sampling, np.asarray(budgets, np.int32),
                    np.asarray(active, bool))


def copy_cache(cache):
  return jax.tree.map(jnp.copy, cache)


def rand_prompts(seed, lengths, vocab=256):
  r = np.random.default_rng(seed)
  return [r.integers(3, vocab, size=n).tolist() for n in lengths]


# ----------------------------------------------------------------------------------------------------
# SamplingParams and logit processors vs NumPy references.


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(stop_token_ids=(1, -2)), "stop_token_ids"),
])
def test_sampling_params_rejects_bad_values(kwargs, match):
  with pytest.raises(ValueError, match=match):
    SamplingParams(**kwargs)


def test_sampling_params_is_hashable_and_normalised():
  a = SamplingParams(temperature=1, top_p=1, stop_token_ids=[2, 5])
  b = SamplingParams(temperature=1.0, top_p=1.0, stop_token_ids=(2, 5))
  assert a == b and hash(a) == hash(b)
  assert a.stop_token_ids == (2, 5)
  assert SamplingParams(stop_token_ids=7).stop_token_ids == (7,)
  assert SamplingParams(temperature=0).greedy


def ref_top_k_mask(x, k):
  x = np.asarray(x, np.float64)
  if k == 0 or k >= x.shape[-1]:
    return np.ones(x.shape, bool)
  kth = np.sort(x, axis=-1)[..., ::-1][..., k - 1:k]
  return x >= kth


def ref_top_p_mask(x, p):
  """Sorted descending, keep tokens until the kept mass reaches p (at least one), row by row."""
  x = np.asarray(x, np.float64)
  out = np.zeros(x.shape, bool)
  for i, row in enumerate(x):
    probs = np.exp(row - row.max())
    probs /= probs.sum()
    mass = 0.0
    for j in np.argsort(-row, kind="stable"):
      out[i, j] = True
      mass += probs[j]
      if mass >= p:
        break
  return out


def test_top_k_mask_matches_numpy(rng):
  x = rng.normal(size=(6, 50)).astype(np.float32) * 2
  for k in (0, 1, 3, 10, 49, 50, 80):
    np.testing.assert_array_equal(smp.top_k_mask(x, k), ref_top_k_mask(x, k), err_msg=f"k={k}")


def test_top_p_mask_matches_numpy(rng):
  x = rng.normal(size=(6, 50)).astype(np.float32) * 2
  x[0, 7] = 30.0  # one token holds almost all the mass: the nucleus is that token alone
  for p in (0.01, 0.2, 0.5, 0.9, 0.999, 1.0):
    got = np.asarray(smp.top_p_mask(x, p))
    np.testing.assert_array_equal(got, ref_top_p_mask(x, p), err_msg=f"top_p={p}")
    assert got.sum(axis=-1).min() >= 1
  assert np.asarray(smp.top_p_mask(x, 0.9))[0].sum() == 1


def ref_sampling_probs(x, temperature, top_k, top_p):
  z = np.asarray(x, np.float64) / temperature
  z = np.where(ref_top_k_mask(z, top_k), z, -np.inf)
  z = np.where(ref_top_p_mask(z, top_p), z, -np.inf)
  return np.exp(np_log_softmax(z))


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 10, 1.0),
                                                       (1.3, 0, 0.8), (0.7, 10, 0.8)])
def test_sample_tokens_logprobs_under_processed_distribution(rng, temperature, top_k, top_p):
  x = rng.normal(size=(64, 40)).astype(np.float32) * 2
  sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
  probs = ref_sampling_probs(x, temperature, top_k, top_p)
  np.testing.assert_allclose(np.exp(smp.process_logits(x, sampling)) /
                             np.exp(smp.process_logits(x, sampling)).sum(-1, keepdims=True), probs,
                             atol=1e-6)
  keys = smp.per_row_keys(1, np.arange(64))
  tokens, logprobs = smp.sample_tokens(keys, x, sampling)
  tokens = np.asarray(tokens)
  chosen = probs[np.arange(64), tokens]
  assert (chosen > 0).all(), "sampled a token outside top-k / top-p"
  np.testing.assert_allclose(logprobs, np.log(chosen), atol=1e-5)


def test_sampler_frequencies_match_probabilities():
  probs = np.array([0.05, 0.0, 0.3, 0.1, 0.25, 0.2, 0.1])
  logits = np.log(np.maximum(probs, 1e-38)).astype(np.float32)
  logits[1] = -np.inf  # a masked token is never drawn
  n = 100_000
  keys = jax.random.split(jax.random.key(3), n)
  tokens, _ = jax.jit(lambda k, x: smp.sample_tokens(k, x, SamplingParams()))(
      keys, np.broadcast_to(logits, (n, 7)))
  freq = np.bincount(np.asarray(tokens), minlength=7) / n
  assert freq[1] == 0
  np.testing.assert_allclose(freq, probs, atol=0.006)


def test_greedy_is_argmax_with_temperature_one_logprob(rng):
  x = rng.normal(size=(5, 300)).astype(np.float32)
  tokens, logprobs = smp.sample_tokens(None, x, SamplingParams(temperature=0.0, top_k=3, top_p=0.5))
  np.testing.assert_array_equal(tokens, x.argmax(-1))
  np.testing.assert_allclose(logprobs, np_log_softmax(x)[np.arange(5), x.argmax(-1)], atol=1e-6)


# ----------------------------------------------------------------------------------------------------
# KV-cached decode / extend vs a full recompute.


def check_turn(model, seq, tokens, logprobs, n, atol=1e-4):
  """The sampled `tokens[:n]` that followed `seq` have temperature-1 log-probs `logprobs[:n]` under
  a full recompute; returns the extended sequence."""
  new = [int(t) for t in tokens[:n]]
  full = full_logits(model, seq + new)
  ref = np_log_softmax(full[len(seq) - 1:len(seq) - 1 + n])[np.arange(n), new]
  np.testing.assert_allclose(logprobs[:n], ref, atol=atol)
  return seq + new


def test_decode_matches_full_recompute_at_every_step(model):
  config, params = model
  prompts = rand_prompts(1, [5, 8, 3])
  sampling = SAMPLE
  keys = smp.per_row_keys(7, np.arange(3))
  cache0, logits0 = prefill(model, prompts)
  for b, p in enumerate(prompts):
    np.testing.assert_allclose(logits0[b], full_logits(model, p)[-1], atol=1e-4)
  out = decode(model, copy_cache(cache0), logits0, keys, sampling)
  np.testing.assert_array_equal(out.lengths, [N] * 3)
  np.testing.assert_array_equal(out.cache.end, [len(p) + N for p in prompts])
  for b, p in enumerate(prompts):
    seq = check_turn(model, p, np.asarray(out.tokens[b]), np.asarray(out.logprobs[b]), N)
    full = full_logits(model, seq)
    np.testing.assert_allclose(out.last_logits[b], full[-1], atol=1e-4)
    # Per-step logits: a decode stopped by a budget of k tokens is a prefix of the long one (same
    # keys), and its last_logits are the cached logits after step k.
    for k in (1, 3, 6):
      budgets = np.full((3,), k, np.int32)
      short = decode(model, copy_cache(cache0), logits0, keys, sampling, budgets)
      np.testing.assert_array_equal(short.tokens[b, :k], out.tokens[b, :k])
      np.testing.assert_array_equal(short.tokens[b, k:], smp.PAD_OUTPUT_ID)
      np.testing.assert_allclose(short.last_logits[b], full[len(p) + k - 1], atol=1e-4)


def test_greedy_decode_is_argmax_of_full_recompute(model):
  config, params = model
  prompts = rand_prompts(2, [4, 7, 2, 8])
  cache, logits = prefill(model, prompts)
  out = decode(model, cache, logits, smp.per_row_keys(0, np.arange(4)), GREEDY)
  for b, p in enumerate(prompts):
    seq = p + np.asarray(out.tokens[b]).tolist()
    full = full_logits(model, seq)
    np.testing.assert_array_equal(out.tokens[b], full[len(p) - 1:-1].argmax(-1))
    np.testing.assert_allclose(out.logprobs[b], np_log_softmax(full[len(p) - 1:-1]).max(-1),
                               atol=1e-4)


def test_multi_turn_episode_matches_full_recompute(model):
  """prefill -> decode -> extend -> decode -> extend -> decode equals one forward pass over the whole
  episode: every behaviour log-prob and every next-token distribution."""
  config, params = model
  prompts = rand_prompts(3, [6, 3])
  observations = [rand_prompts(4, [5, 0]), rand_prompts(5, [2, 7])]  # row 1 gets no first obs
  sampling = SamplingParams(temperature=1.0, max_new_tokens=N, stop_token_ids=(17,))
  keys = smp.per_row_keys(11, np.arange(2))
  turn_budgets = [np.array([3, 8]), np.array([8, 2]), np.array([5, 4])]
  turn_active = [np.array([True, True]), np.array([True, False]), np.array([True, True])]
  seqs = [list(p) for p in prompts]
  cache, logits = prefill(model, prompts)
  for turn in range(3):
    before_end = np.asarray(cache.end)
    before_logits = np.asarray(logits)
    out = decode(model, cache, logits, keys, sampling, turn_budgets[turn],
                     turn_active[turn])
    for b in range(2):
      n = int(out.lengths[b])
      if not turn_active[turn][b]:
        assert n == 0 and out.cache.end[b] == before_end[b]
        np.testing.assert_array_equal(out.last_logits[b], before_logits[b])
        continue
      toks = np.asarray(out.tokens[b])
      stop_at = [i for i, t in enumerate(toks[:n]) if t == 17]
      assert n == (stop_at[0] + 1 if stop_at else turn_budgets[turn][b])
      assert bool(out.stopped_by_stop_token[b]) == bool(stop_at)
      seqs[b] = check_turn(model, seqs[b], toks, np.asarray(out.logprobs[b]), n)
      assert out.cache.end[b] == len(seqs[b])
      np.testing.assert_allclose(out.last_logits[b], full_logits(model, seqs[b])[-1], atol=1e-4)
    cache, logits = out.cache, out.last_logits
    if turn < 2:
      obs_tokens, obs_lengths = pad_batch(observations[turn], width=WIDTH, pad_id=2)
      prev_logits = np.asarray(logits)
      cache, logits = smp.extend(params, config, cache, obs_tokens, obs_lengths, logits)
      for b in range(2):
        seqs[b] = seqs[b] + observations[turn][b]
        assert cache.end[b] == len(seqs[b])
        expected = full_logits(model, seqs[b])[-1] if obs_lengths[b] else prev_logits[b]
        np.testing.assert_allclose(logits[b], expected, atol=1e-4)


def test_padding_invariance(model):
  config, params = model
  prompt = rand_prompts(6, [5])[0]
  sampling = NUCLEUS
  keys = smp.per_row_keys(3, np.arange(1))
  results = []
  for width, pad_id in ((WIDTH, 0), (16, 2)):
    cache, logits = prefill(model, [prompt], width=width, pad_id=pad_id)
    out = decode(model, cache, logits, keys, sampling)
    results.append(out)
  np.testing.assert_array_equal(results[0].tokens, results[1].tokens)
  np.testing.assert_allclose(results[0].logprobs, results[1].logprobs, atol=1e-5)


def test_batch_composition_invariance(model):
  """A row's tokens and log-probs depend on its prompt and key only, not on its neighbours or batch
  position."""
  config, params = model
  row, others = rand_prompts(7, [6])[0], rand_prompts(8, [3, 8])
  sampling = NUCLEUS
  key = smp.per_row_keys(5, np.array([42]))  # the row's own key, wherever it sits
  other_keys = smp.per_row_keys(5, np.array([1, 2]))

  def run(prompts, keys):
    cache, logits = prefill(model, prompts)
    return decode(model, cache, logits, keys, sampling)

  alone = run([row], key)
  first = run([row] + others, jnp.concatenate([key, other_keys]))
  last = run(others + [row], jnp.concatenate([other_keys, key]))
  for out, b in ((first, 0), (last, 2)):
    np.testing.assert_array_equal(out.tokens[b], alone.tokens[0])
    np.testing.assert_allclose(out.logprobs[b], alone.logprobs[0], atol=1e-5)
  assert not np.array_equal(first.tokens[1], alone.tokens[0])


def test_pad_id_inside_prompt_is_a_real_token(model):
  """Token 2 (`<|im_end|>`, SmolLM2's pad id) inside a prompt is attended to like any token."""
  config, params = model
  with_two, without = [5, 9, 2, 7, 11], [5, 9, 7, 11]
  cache, logits = prefill(model, [with_two, without], pad_id=2)
  np.testing.assert_array_equal(cache.end, [5, 4])
  np.testing.assert_allclose(logits[0], full_logits(model, with_two)[-1], atol=1e-4)
  np.testing.assert_allclose(logits[1], full_logits(model, without)[-1], atol=1e-4)
  assert np.abs(np.asarray(logits[0]) - np.asarray(logits[1])).max() > 1e-3
  # Same inside an observation: extend with [2, 4] equals the full pass over the concatenation.
  obs, obs_len = pad_batch([[2, 4], [4]], pad_id=2)
  cache, logits = smp.extend(params, config, cache, obs, obs_len)
  np.testing.assert_allclose(logits[0], full_logits(model, with_two + [2, 4])[-1], atol=1e-4)
  np.testing.assert_allclose(logits[1], full_logits(model, without + [4])[-1], atol=1e-4)


def test_stop_tokens_budgets_and_inactive_rows(model):
  config, params = model
  prompts = rand_prompts(9, [4, 6, 5, 3])
  keys = smp.per_row_keys(0, np.arange(4))
  greedy = GREEDY
  cache, logits = prefill(model, prompts)
  free = decode(model, copy_cache(cache), logits, keys, greedy)
  stop = int(free.tokens[0, 2])  # row 0 stops at its third token
  budgets = np.array([N, 3, N, 0])
  active = np.array([True, True, False, True])
  out = decode(model, cache, logits, keys, greedy.replace(stop_token_ids=(stop,)),
                   budgets, active)
  for b in range(4):
    toks = np.asarray(free.tokens[b])
    hits = [i for i, t in enumerate(toks) if t == stop]
    limit = budgets[b] if active[b] else 0
    expected = min(hits[0] + 1, limit) if hits else limit
    assert out.lengths[b] == expected, b
    assert bool(out.stopped_by_stop_token[b]) == (bool(hits) and hits[0] < limit)
    np.testing.assert_array_equal(out.tokens[b, :expected], toks[:expected])
    np.testing.assert_array_equal(out.tokens[b, expected:], smp.PAD_OUTPUT_ID)
    np.testing.assert_array_equal(out.logprobs[b, expected:], 0.0)
    assert out.cache.end[b] == len(prompts[b]) + expected
  assert out.lengths[0] <= 3 and out.stopped_by_stop_token[0]
  assert out.tokens[0, out.lengths[0] - 1] == stop  # the stop token ends the turn and is kept
  for b in (2, 3):  # inactive / zero budget: nothing changes
    np.testing.assert_array_equal(out.last_logits[b], logits[b])
  for b in (0, 1):  # rows that stopped (at different steps) return the logits after their last token
    seq = list(prompts[b]) + np.asarray(out.tokens[b, :int(out.lengths[b])]).tolist()
    np.testing.assert_allclose(out.last_logits[b], full_logits(model, seq)[-1], atol=1e-4)


def test_decode_never_writes_past_capacity(model):
  config, params = model
  prompts = rand_prompts(10, [8, 2])
  cache, logits = prefill(model, prompts, capacity=12)
  out = decode(model, cache, logits, smp.per_row_keys(0, np.arange(2)), SAMPLE)
  np.testing.assert_array_equal(out.lengths, [4, N])
  np.testing.assert_array_equal(out.cache.end, [12, 10])
  assert not smp.overflowed(out.cache).any()


def test_determinism_given_keys(model):
  config, params = model
  prompts = rand_prompts(12, [5, 7, 2])
  sampling = SAMPLE

  def run(seed):
    cache, logits = prefill(model, prompts)
    return decode(model, cache, logits, smp.per_row_keys(seed, np.arange(3)), sampling)

  a, b, c = run(0), run(0), run(1)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.logprobs, b.logprobs)
  assert not np.array_equal(a.tokens, c.tokens)


def test_generate(model):
  config, params = model
  prompts = [[5, 6, 7], [8, 2, 9, 10, 11], [3]]
  sampling = SamplingParams(temperature=1.0, max_new_tokens=N, stop_token_ids=(40,))
  results = smp.generate(params, config, prompts, sampling, seed=4)
  assert len(results) == 3
  for prompt, (toks, logprobs) in zip(prompts, results):
    assert 1 <= len(toks) <= N and len(logprobs) == len(toks) and logprobs.dtype == np.float32
    assert 40 not in toks[:-1]
    check_turn(model, prompt, np.array(toks), logprobs, len(toks))
  assert smp.generate(params, config, prompts, sampling, seed=4)[1][0] == results[1][0]
  # A prompt's completion does not depend on the prompts after it.
  assert smp.generate(params, config, prompts[:1], sampling, seed=4)[0][0] == results[0][0]
  with pytest.raises(ValueError, match="empty"):
    smp.generate(params, config, [[1], []], sampling)
  with pytest.raises(ValueError, match="vocab_size"):
    smp.generate(params, config, [[1, 999]], sampling)


def test_no_retrace(model, assert_no_retrace):
  config, params = model
  sampling = SAMPLE
  batches = [pad_batch(rand_prompts(s, [3, 8])) for s in (20, 21, 22)]
  assert_no_retrace(smp.prefill, *[((params, config, t, l, CAPACITY), {}) for t, l in batches])
  assert_no_retrace(smp.extend, *[
      ((params, config, prefill(model, rand_prompts(s, [2, 4]))[0], t, l), {})
      for s, (t, l) in zip((30, 31, 32), batches)])
  decode_calls = []
  for s in (40, 41, 42):
    cache, logits = prefill(model, rand_prompts(s, [5, 1]))
    decode_calls.append(((params, config, cache, logits, smp.per_row_keys(s, np.arange(2)),
                          sampling, np.array([s % 5, 8]), np.array([True, s % 2 == 0])), {}))
  assert_no_retrace(smp.decode, *decode_calls)


def test_decode_requires_keys_unless_greedy(model):
  cache, logits = prefill(model, rand_prompts(13, [4, 2, 6, 1]))
  with pytest.raises(ValueError, match="keys"):
    decode(model, copy_cache(cache), logits, None, SAMPLE)
  with_none = decode(model, copy_cache(cache), logits, None, GREEDY)
  with_keys = decode(model, cache, logits, smp.per_row_keys(0, np.arange(4)), GREEDY)
  np.testing.assert_array_equal(with_none.tokens, with_keys.tokens)


def test_pad_rows_by_hand():
  tokens, lengths = smp.pad_rows([[5, 6, 7], [1]], minimum=2)
  np.testing.assert_array_equal(tokens, [[5, 6, 7, 0], [1, 0, 0, 0]])  # next power of two: 4
  np.testing.assert_array_equal(lengths, [3, 1])
  assert smp.pad_rows([[1] * 9], minimum=8)[0].shape == (1, 16)
  assert smp.pad_rows([[1] * 9], minimum=8, maximum=12)[0].shape == (1, 12)
  assert smp.pad_rows([[1]])[0].shape == (1, 16)  # generate's minimum width

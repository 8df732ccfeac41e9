"""KV-cached sampling: jitted `prefill` / `extend` / `decode`, and the logit processors they use.

One multi-turn episode (all rows of a batch advance together, each with its own lengths):

  cache, logits = prefill(params, config, prompt_tokens, prompt_lengths, capacity)
  out = decode(params, config, cache, logits, keys, sampling, budgets, active)      # turn 0
  cache, logits = extend(params, config, out.cache, obs_tokens, obs_lengths, out.last_logits)
  out = decode(params, config, cache, logits, keys, sampling, budgets, active)      # turn 1
  ...

The cache holds every token the policy saw or produced (prompt, sampled tokens, observations), so no
turn recomputes its prefix: a k-turn episode costs what one turn with the same tokens costs.

Conventions:
- **The model** is `models.family(config)` (`config.family`, default "llama"): every model call goes
  through that lookup, and the cache is the family's (`models.DecodeCache`: `end [B]`, `capacity`).
  `config.decode_kernel` chooses the decode step's attention kernel; `config` is a static argument of
  every jitted function here, so changing it retraces.
- **Parameters**: raw `Transformer` params or `models.prepare_decode_params(params, config)` (per-layer
  arrays in the compute dtype). Prepare once per policy version: raw params are split inside every
  compiled call (a copy of the weights per call, outside the decode loop).
- **Right padding, masks from lengths.** `tokens[B, T]` with `lengths[B]` real tokens at the start of
  each row; padding never acts as a key whatever its id (SmolLM2 pads with `<|im_end|>` = 2, which is
  also a real token). A row with length 0 is left unchanged.
- **Caches are donated** to `extend` and `decode` (updated in place, no copy of the largest array of
  the sampler); the cache passed in is deleted. Keep using the returned one (or pass a copy:
  `jax.tree.map(jnp.copy, cache)`).
- **Randomness is per row.** `keys[B]` holds one PRNG key per row (typed keys `[B]` or raw `uint32
  [B, 2]`; `per_row_keys(seed, row_ids)` builds them). The token written at cache slot `s` of row `b`
  is drawn with `fold_in(keys[b], s)`: a row's samples depend only on its own key and tokens, never on
  the other rows, its batch position or its padding, and successive turns draw fresh noise even when the
  same keys are passed again. Equal keys give identical outputs.
- **Capacity.** `decode` never writes past the cache: a row's budget is clipped to the free slots
  `capacity - end`. `extend` cannot clip an observation; writing past the capacity drops the tokens and
  leaves `end > capacity` (see `overflowed`). Context budgets are the rollout loop's business.
- **Benchmarking decode throughput:** `SamplingParams(stop_token_ids=(), max_new_tokens=N)` with
  `budgets=None` runs exactly `N` model steps for every row (each step is one batched model call).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from longhorizon.models.config import ModelConfig
from longhorizon.models.families import DecodeCache, family

__all__ = ["SamplingParams", "DecodeResult", "prefill", "extend", "decode", "generate", "fork_cache",
           "pad_rows", "per_row_keys", "overflowed", "apply_temperature", "top_k_mask",
           "top_p_mask", "process_logits", "sample_tokens", "PAD_OUTPUT_ID"]

_F32 = jnp.float32
PAD_OUTPUT_ID = 0  # id written to `DecodeResult.tokens` past a row's length (its logprob is 0)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How tokens are drawn. Frozen and hashable: a static argument of `decode`.

  The processors apply in the order temperature -> top-k -> top-p (as HF `generate` does); top-p
  measures mass under the temperature-scaled, top-k-truncated distribution.
  """
  temperature: float = 1.0  # 0 -> greedy (argmax; top_k/top_p are then irrelevant); > 0 divides logits
  top_k: int = 0  # keep the k largest logits (ties with the k-th are kept); 0 -> off
  top_p: float = 1.0  # nucleus: keep the smallest set of tokens with mass >= top_p; 1.0 -> off
  max_new_tokens: int = 256  # N: static length of `DecodeResult.tokens[B, N]`; upper bound of budgets
  stop_token_ids: tuple[int, ...] = ()  # sampling one of these ends the row (it is kept in the output)

  def __post_init__(self):
    stop = self.stop_token_ids
    if isinstance(stop, (int, np.integer)):
      stop = (stop,)
    try:
      stop = tuple(int(t) for t in stop)
    except TypeError as e:
      raise ValueError(f"stop_token_ids must be a sequence of int token ids, got {stop!r}.") from e
    if any(t < 0 for t in stop):
      raise ValueError(f"stop_token_ids must be non-negative token ids, got {stop}.")
    object.__setattr__(self, "stop_token_ids", stop)
    temperature = float(self.temperature)
    if not math.isfinite(temperature) or temperature < 0:
      raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}.")
    object.__setattr__(self, "temperature", temperature)
    if isinstance(self.top_k, bool) or int(self.top_k) != self.top_k or self.top_k < 0:
      raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}.")
    object.__setattr__(self, "top_k", int(self.top_k))
    top_p = float(self.top_p)
    if not 0.0 < top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1] (1.0 = off), got {self.top_p}.")
    object.__setattr__(self, "top_p", top_p)
    if (isinstance(self.max_new_tokens, bool) or int(self.max_new_tokens) != self.max_new_tokens
        or self.max_new_tokens < 1):
      raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}.")
    object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0

  def replace(self, **changes) -> "SamplingParams":
    return dataclasses.replace(self, **changes)


@flax.struct.dataclass
class DecodeResult:
  """What one `decode` call produced. `N = sampling.max_new_tokens`."""
  tokens: jax.Array  # [B, N] int32 sampled ids; PAD_OUTPUT_ID at columns >= lengths
  # [B, N] float32 log-prob of each sampled token under the distribution it was drawn from (after
  # temperature / top-k / top-p); greedy rows record the temperature-1 log-prob log_softmax(logits).
  # 0 at columns >= lengths.
  logprobs: jax.Array
  lengths: jax.Array  # [B] int32 tokens sampled per row (a final stop token included)
  stopped_by_stop_token: jax.Array  # [B] bool: the row's last token is in stop_token_ids
  cache: DecodeCache  # input cache with every sampled token appended (end += lengths)
  last_logits: jax.Array  # [B, V] float32 next-token logits after the row's last token


# ----------------------------------------------------------------------------------------------------
# Logit processors: pure functions of `[..., V]` logits.


def apply_temperature(logits: chex.Array, temperature: float) -> jax.Array:
  """float32 `logits / temperature` (`temperature > 0`)."""
  if temperature <= 0:
    raise ValueError(f"apply_temperature needs temperature > 0, got {temperature}.")
  return jnp.asarray(logits).astype(_F32) / jnp.asarray(temperature, _F32)


def top_k_mask(logits: chex.Array, k: int) -> jax.Array:
  """`[..., V]` bool: True on the `k` largest logits (and on exact ties with the k-th); all True when
  `k == 0` or `k >= V`."""
  logits = jnp.asarray(logits)
  if k < 0:
    raise ValueError(f"top_k must be >= 0, got {k}.")
  if k == 0 or k >= logits.shape[-1]:
    return jnp.ones(logits.shape, bool)
  # A min over the k values, not a slice of the last one: XLA:CPU turns `top_k(...)[..., -1:]` into a
  # full sort (60x slower on a 49k vocabulary).
  kth = jnp.min(jax.lax.top_k(logits, k)[0], axis=-1, keepdims=True)
  return logits >= kth


def top_p_mask(logits: chex.Array, top_p: float) -> jax.Array:
  """`[..., V]` bool nucleus of `softmax(logits)`: the smallest set of most likely tokens whose mass
  is `>= top_p` (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration"); always holds
  the most likely token; exact ties with the least likely kept token are kept too.

  The set is `{v : p_v >= tau}` with `tau = max{t : sum_v p_v [p_v >= t] >= top_p}`. Instead of a sort
  (XLA:CPU sorts a 49k vocabulary at ~10 ms per row), `tau` is found by bisection over the bit
  patterns of non-negative float32 numbers (ordered like the numbers they encode): 31 masked sums,
  exact up to float summation order.
  """
  logits = jnp.asarray(logits).astype(_F32)
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
  if top_p >= 1.0:
    return jnp.ones(logits.shape, bool)
  probs = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))  # unnormalised, max exactly 1
  target = top_p * jnp.sum(probs, axis=-1, keepdims=True)
  batch_shape = logits.shape[:-1] + (1,)

  def mass_at_least(bits):
    tau = jax.lax.bitcast_convert_type(bits, _F32)
    return jnp.sum(jnp.where(probs >= tau, probs, 0.0), axis=-1, keepdims=True)

  def bisect(_, bounds):
    lo, hi = bounds  # invariant: mass(p >= lo) >= target > mass(p >= hi)
    mid = lo + (hi - lo) // 2
    good = mass_at_least(mid) >= target
    return jnp.where(good, mid, lo), jnp.where(good, hi, mid)

  one_bits = jax.lax.bitcast_convert_type(jnp.float32(1.0), jnp.int32)
  lo = jnp.zeros(batch_shape, jnp.int32)  # tau = 0 keeps everything
  hi = jnp.full(batch_shape, one_bits + 1, jnp.int32)  # tau just above the max keeps nothing
  lo, _ = jax.lax.fori_loop(0, 31, bisect, (lo, hi))
  return probs >= jax.lax.bitcast_convert_type(lo, _F32)


def process_logits(logits: chex.Array, sampling: SamplingParams) -> jax.Array:
  """float32 `[..., V]` logits of the sampling distribution: `logits / temperature`, with tokens outside
  top-k / top-p set to `-inf`. Greedy (`temperature == 0`) returns the float32 logits unchanged."""
  logits = jnp.asarray(logits).astype(_F32)
  if sampling.greedy:
    return logits
  scaled = apply_temperature(logits, sampling.temperature)
  if sampling.top_k:
    scaled = jnp.where(top_k_mask(scaled, sampling.top_k), scaled, -jnp.inf)
  if sampling.top_p < 1.0:
    scaled = jnp.where(top_p_mask(scaled, sampling.top_p), scaled, -jnp.inf)
  return scaled


def _inverse_cdf_sample(key, logits):
  """One draw from `softmax(logits)` (`logits [V]`, `-inf` allowed) by inverting the CDF at a single
  uniform, in two levels (blocks of ~sqrt(V) tokens, then tokens inside the chosen block).

  Why not `jax.random.categorical`: its Gumbel-max trick draws `V` random numbers per token, which on
  CPU costs more than the rest of sampling (~25 ms per step for 16 rows of a 49k vocabulary); this
  draws one. Two levels because XLA:CPU's cumsum over a whole 49k row is slow too.

  Returns `(token int32, log_prob float32)`, the log-prob being `log softmax(logits)[token]`.
  """
  v = logits.shape[-1]
  block = 1 << max(0, math.ceil(0.5 * math.log2(v)))  # a power of two >= sqrt(V)
  num_blocks = -(-v // block)
  top = jnp.max(logits)
  probs = jnp.exp(logits - top)  # unnormalised, max exactly 1, 0 on -inf
  blocks = jnp.pad(probs, (0, num_blocks * block - v)).reshape(num_blocks, block)
  block_mass = jnp.sum(blocks, axis=-1)
  block_cdf = jnp.cumsum(block_mass)
  total = block_cdf[-1]
  u = jax.random.uniform(key, (), _F32) * total

  def pick(cdf, mass, x):
    # First index whose cdf exceeds x, kept inside [first, last] positive-mass entries so float
    # rounding at either end can never select a zero-probability token.
    idx = jnp.sum(cdf <= x)
    positive = mass > 0
    first = jnp.argmax(positive)
    last = mass.shape[0] - 1 - jnp.argmax(positive[::-1])
    return jnp.clip(idx, first, last)

  b = pick(block_cdf, block_mass, u)
  within = blocks[b]
  residual = u - (block_cdf[b] - block_mass[b])
  token = (b * block + pick(jnp.cumsum(within), within, residual)).astype(jnp.int32)
  return token, logits[token] - top - jnp.log(total)


def _greedy(logits):
  """`(argmax logits, log softmax(logits)[argmax])` for `logits [V]`; the first index among ties.
  Two plain reductions: XLA:CPU's variadic argmax reduction is ~3x slower."""
  top = jnp.max(logits)
  token = jnp.min(jnp.where(logits == top, jnp.arange(logits.shape[-1]), logits.shape[-1]))
  token = token.astype(jnp.int32)
  return token, -jnp.log(jnp.sum(jnp.exp(logits - top)))


def sample_tokens(keys: chex.Array, logits: chex.Array,
                  sampling: SamplingParams) -> tuple[jax.Array, jax.Array]:
  """Draws one token per row.

  Args:
    keys: `[B]` typed PRNG keys or `[B, 2]` raw uint32 keys, one per row (unused when greedy).
    logits: `[B, V]` next-token logits.
    sampling: the sampling rule.

  Returns:
    `(tokens[B] int32, logprobs[B] float32)`: greedy takes `argmax logits` and records its
    temperature-1 log-prob `log_softmax(logits)[token]`; otherwise `token ~ softmax(process_logits)`
    (exact inverse-CDF draw from one uniform per row) and the log-prob is taken under that same
    (truncated, renormalised) distribution.
  """
  logits = jnp.asarray(logits)
  chex.assert_rank(logits, 2)
  processed = process_logits(logits, sampling)
  if sampling.greedy:
    return jax.vmap(_greedy)(processed)
  chex.assert_axis_dimension(keys, 0, logits.shape[0])
  return jax.vmap(_inverse_cdf_sample)(keys, processed)


# ----------------------------------------------------------------------------------------------------
# Model calls.


def per_row_keys(key_or_seed, row_ids: chex.Array) -> jax.Array:
  """`[B]` keys `fold_in(key, row_ids[b])`: a row's key depends on its id only (stable when the batch
  is reshuffled). `key_or_seed`: an int seed or a PRNG key."""
  key = key_or_seed
  if isinstance(key_or_seed, (int, np.integer)):
    key = jax.random.key(int(key_or_seed))
  row_ids = jnp.asarray(row_ids)
  chex.assert_rank(row_ids, 1)
  return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, row_ids)


@jax.jit
def fork_cache(cache: DecodeCache, rows: chex.Array, ends: chex.Array) -> DecodeCache:
  """A cache of `len(rows)` rows: row `i` is a copy of `cache`'s row `rows[i]` cut to its first
  `ends[i]` slots (`end = ends[i]`; the slots after are free to be written again).

  Slot `s` of a row holds the keys and values of the token at position `s`, which only the tokens
  before it determine: a prefix of a finished episode's cache is the cache of that prefix. Forking
  copies it instead of encoding the prefix again (branch rollouts: K continuations of one prefix
  cost their own tokens only). `cache` is not donated.

  Args:
    cache: a family's `DecodeCache` (every leaf has the rows on axis 0).
    rows: `[R]` int row indices into `cache` (repeats allowed).
    ends: `[R]` int slots kept per row, `0 <= ends[i] <= cache.end[rows[i]]`.
  """
  rows, ends = jnp.asarray(rows, jnp.int32), jnp.asarray(ends, jnp.int32)
  chex.assert_rank([rows, ends], 1)
  chex.assert_equal_shape([rows, ends])
  forked = jax.tree.map(lambda x: jnp.take(x, rows, axis=0), cache)
  return forked.replace(end=jnp.minimum(ends, cache.end[rows]))


def overflowed(cache: DecodeCache) -> jax.Array:
  """`[B]` bool: rows that were extended past the cache capacity (tokens were dropped)."""
  return cache.end > cache.capacity


def _append_hidden(params, config: ModelConfig, cache: DecodeCache, tokens, lengths, rope=None):
  """Appends `tokens[B, T]` (`lengths[B]` real) to the cache; returns the cache and the final-normed
  hidden state `[B, D]` after each row's last new token (undefined for rows with length 0). `rope`:
  optional precomputed position tables (see `cached_forward`)."""
  out = family(config).cached_forward(params, config, tokens, cache, lengths=lengths, rope=rope)
  b, t = tokens.shape
  last = jnp.clip(lengths - 1, 0, t - 1)
  return out.cache, out.hidden[jnp.arange(b), last]


def _append(params, config: ModelConfig, cache: DecodeCache, tokens,
            lengths) -> tuple[DecodeCache, jax.Array]:
  """As `_append_hidden`, returning the logits `[B, V]` after each row's last new token. Logits are
  computed only at that position, never `[B, T, V]`."""
  cache, hidden = _append_hidden(params, config, cache, tokens, lengths)
  return cache, family(config).decode_logits(params, config, hidden)


def _check_tokens_lengths(tokens, lengths):
  chex.assert_rank(tokens, 2)
  chex.assert_rank(lengths, 1)
  chex.assert_type([tokens, lengths], int)
  chex.assert_axis_dimension(lengths, 0, tokens.shape[0])


@functools.partial(jax.jit, static_argnames=("config", "capacity"))
def prefill(params, config: ModelConfig, tokens: chex.Array, lengths: chex.Array,
            capacity: int) -> tuple[DecodeCache, jax.Array]:
  """Encodes right-padded prompts into a fresh cache.

  Args:
    params: `Transformer(config)` parameters or `DecodeParams` (see module docstring).
    config: model config (static).
    tokens: `[B, T]` int prompt ids, right-padded (pad ids are arbitrary).
    lengths: `[B]` int real tokens per row, `0 <= lengths <= T`.
    capacity: cache slots per row (static), `>= T`; holds prompt, all turns and observations.

  Returns:
    `(cache, last_logits)`: the cache with `end = lengths`, and `[B, V]` float32 logits of the next
    token after each prompt (zeros, i.e. uniform, for an empty row).
  """
  _check_tokens_lengths(tokens, lengths)
  b, t = tokens.shape
  if capacity < t:
    raise ValueError(f"capacity={capacity} is smaller than the prompt width T={t}; the cache must "
                     "hold the prompt and every generated token.")
  cache = family(config).init_cache(config, b, capacity)
  return _extend(params, config, cache, tokens, lengths, None)


def _extend(params, config, cache, tokens, lengths, last_logits):
  params = family(config).prepare_decode_params(params, config)
  _check_tokens_lengths(tokens, lengths)
  chex.assert_axis_dimension(cache.end, 0, tokens.shape[0])
  if tokens.shape[1] > cache.capacity:
    raise ValueError(f"cannot append T={tokens.shape[1]} tokens to a cache of capacity "
                     f"{cache.capacity}.")
  lengths = lengths.astype(jnp.int32)
  new_cache, logits = _append(params, config, cache, tokens.astype(jnp.int32), lengths)
  if last_logits is None:
    last_logits = jnp.zeros_like(logits)
  else:
    chex.assert_shape(last_logits, logits.shape)
  return new_cache, jnp.where((lengths > 0)[:, None], logits, last_logits.astype(_F32))


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",))
def extend(params, config: ModelConfig, cache: DecodeCache, tokens: chex.Array, lengths: chex.Array,
           last_logits: chex.Array | None = None) -> tuple[DecodeCache, jax.Array]:
  """Appends new tokens (an observation, a tool result) to each row of an existing cache.

  The new tokens of row `b` take slots and positions `cache.end[b] + t` and attend to the whole
  cached prefix, so the result equals a full forward pass over prefix + new tokens.

  Args:
    params, config: as for `prefill`.
    cache: the episode's cache (donated: do not reuse it).
    tokens: `[B, T]` int ids, right-padded.
    lengths: `[B]` int real tokens per row, `0 <= lengths <= T`; a row with 0 is left unchanged.
    last_logits: optional `[B, V]` current next-token logits, returned for rows with length 0 (zeros
      when omitted).

  Returns:
    `(cache, last_logits)` with `end += lengths` and the `[B, V]` float32 logits after each row's last
    token.
  """
  return _extend(params, config, cache, tokens, lengths, last_logits)


# ----------------------------------------------------------------------------------------------------
# Decoding: one `lax.while_loop` over `_decode_step`.


@flax.struct.dataclass
class _DecodeState:
  step: jax.Array  # [] int32 loop counter (column of the next token)
  tokens: jax.Array  # [B, N] int32
  logprobs: jax.Array  # [B, N] float32
  lengths: jax.Array  # [B] int32
  done: jax.Array  # [B] bool
  stopped: jax.Array  # [B] bool
  cache: DecodeCache
  next_tokens: jax.Array  # [B] int32 drawn from the row's current next-token logits
  next_logprobs: jax.Array  # [B] float32 their log-probs
  last_hidden: jax.Array  # [B, D] hidden state after each row's last written token
  wrote: jax.Array  # [B] bool: the row wrote at least one token


@functools.partial(jax.jit, static_argnames=("config", "sampling"), donate_argnames=("cache",))
def decode(params, config: ModelConfig, cache: DecodeCache, last_logits: chex.Array, keys: chex.Array,
           sampling: SamplingParams, budgets: chex.Array | None = None,
           active: chex.Array | None = None) -> DecodeResult:
  """Samples up to `sampling.max_new_tokens` tokens per row in one `lax.while_loop`.

  Each iteration (`_decode_step`) records one token for every unfinished row (drawn from its latest
  next-token logits), appends it to the cache with one batched model call (finished rows append
  nothing: length 0), and draws the row's next token from the new logits. A row finishes when it
  samples a stop token (kept in the output and counted in its length, since it ends the turn) or
  reaches its budget; the loop exits when every row has finished. The returned cache holds every
  sampled token, so `extend` can continue the episode.

  Args:
    params, config: as for `prefill`.
    cache: the episode's cache (donated: do not reuse it).
    last_logits: `[B, V]` next-token logits (from `prefill`, `extend` or a previous `decode`).
    keys: `[B]` typed or `[B, 2]` raw PRNG keys, one per row; the token for cache slot `s` is drawn
      with `fold_in(keys[b], s)` (see module docstring). Ignored (may be None) when greedy.
    sampling: the sampling rule (static).
    budgets: optional `[B]` int max tokens per row, clipped to `[0, max_new_tokens]` and to the free
      cache slots `capacity - end`; default `max_new_tokens`.
    active: optional `[B]` bool rows to decode; inactive rows are returned unchanged. Default all.

  Returns:
    `DecodeResult`.
  """
  last_logits, budgets, active = _check_decode_inputs(cache, last_logits, keys, sampling, budgets,
                                                      active)
  n = sampling.max_new_tokens
  stop_ids = jnp.asarray(sampling.stop_token_ids, jnp.int32)
  model = family(config)
  params = model.prepare_decode_params(params, config)  # once, outside the loop (no-op if prepared)
  # Position tables for every step, built once: a row that writes at step i has written at every
  # earlier step, so its token sits at position `end + i` (rows that do not write are not used).
  rope = model.position_tables(cache.end[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :], config)
  step = functools.partial(_decode_step, params=params, config=config, keys=keys, sampling=sampling,
                           rope=rope, budgets=budgets, stop_ids=stop_ids)
  last_logits = last_logits.astype(_F32)
  init = _initial_decode_state(config, cache, last_logits, keys, sampling, budgets, active)
  s = jax.lax.while_loop(lambda s: (s.step < n) & ~jnp.all(s.done), step, init)
  final_logits = jnp.where(s.wrote[:, None], model.decode_logits(params, config, s.last_hidden),
                           last_logits)
  return DecodeResult(tokens=s.tokens, logprobs=s.logprobs, lengths=s.lengths,
                      stopped_by_stop_token=s.stopped, cache=s.cache, last_logits=final_logits)


def _check_decode_inputs(cache: DecodeCache, last_logits, keys, sampling: SamplingParams, budgets,
                         active):
  """`decode`'s shape checks and defaults: `(last_logits [B, V], budgets [B] int32 clipped to
  `[0, N]` and to the free slots, active [B])`."""
  last_logits = jnp.asarray(last_logits)
  chex.assert_rank(last_logits, 2)
  b = last_logits.shape[0]
  n = sampling.max_new_tokens
  chex.assert_axis_dimension(cache.end, 0, b)
  if keys is None and not sampling.greedy:
    raise ValueError("decode needs keys[B] (one PRNG key per row) unless sampling is greedy "
                     "(temperature=0); build them with per_row_keys(seed, row_ids).")
  if keys is not None:
    chex.assert_axis_dimension(keys, 0, b)
  if budgets is None:
    budgets = jnp.full((b,), n, jnp.int32)
  chex.assert_shape(budgets, (b,))
  if active is None:
    active = jnp.ones((b,), bool)
  chex.assert_shape(active, (b,))
  free_slots = jnp.maximum(cache.capacity - cache.end, 0)
  budgets = jnp.minimum(jnp.clip(budgets.astype(jnp.int32), 0, n), free_slots)
  return last_logits, budgets, active


def _draw(keys, logits, cache_end, sampling: SamplingParams):
  """The next token of every row, for cache slot `cache_end[B]` (see module docstring)."""
  step_keys = None if keys is None else jax.vmap(jax.random.fold_in)(keys, cache_end)
  return sample_tokens(step_keys, logits, sampling)


def _initial_decode_state(config: ModelConfig, cache: DecodeCache, last_logits, keys,
                          sampling: SamplingParams, budgets, active) -> _DecodeState:
  """The loop state before the first step: nothing written, the first tokens drawn from
  `last_logits [B, V]` float32; rows inactive or without budget start done."""
  b, n = last_logits.shape[0], sampling.max_new_tokens
  next_tokens, next_logprobs = _draw(keys, last_logits, cache.end, sampling)
  return _DecodeState(
      step=jnp.zeros((), jnp.int32),
      tokens=jnp.full((b, n), PAD_OUTPUT_ID, jnp.int32),
      logprobs=jnp.zeros((b, n), _F32),
      lengths=jnp.zeros((b,), jnp.int32),
      done=~active.astype(bool) | (budgets <= 0),
      stopped=jnp.zeros((b,), bool),
      cache=cache,
      next_tokens=next_tokens,
      next_logprobs=next_logprobs,
      last_hidden=jnp.zeros((b, config.hidden_size), jnp.dtype(config.dtype)),
      wrote=jnp.zeros((b,), bool))


def _decode_step(s: _DecodeState, *, params, config: ModelConfig, keys, sampling: SamplingParams,
                 rope, budgets, stop_ids) -> _DecodeState:
  """One iteration of `decode`'s loop: writes the token drawn at the end of the previous one, then
  draws the next from the fresh logits.

  Logits never enter the loop state: carrying `[B, V]` and selecting the old logits for finished rows
  cost a pass over `B x V` floats every step (~2 ms at B=64 on SmolLM2); finished rows keep their
  `[B, D]` hidden state instead, and `decode` computes the returned logits from it once, after the
  loop. `rope`: the position tables of all `N` steps (this step's column is sliced out).
  """
  write = ~s.done
  tok = jnp.where(write, s.next_tokens, PAD_OUTPUT_ID)
  logp = jnp.where(write, s.next_logprobs, 0.0)
  lengths = s.lengths + write.astype(jnp.int32)
  hit_stop = (write & jnp.isin(tok, stop_ids)) if sampling.stop_token_ids else jnp.zeros_like(write)
  step_rope = jax.tree.map(lambda table: jax.lax.dynamic_slice_in_dim(table, s.step, 1, axis=1), rope)
  new_cache, hidden = _append_hidden(params, config, s.cache, tok[:, None], write.astype(jnp.int32),
                                     step_rope)
  logits = family(config).decode_logits(params, config, hidden)
  next_tokens, next_logprobs = _draw(keys, logits, new_cache.end, sampling)
  return _DecodeState(
      step=s.step + 1,
      tokens=jax.lax.dynamic_update_index_in_dim(s.tokens, tok, s.step, axis=1),
      logprobs=jax.lax.dynamic_update_index_in_dim(s.logprobs, logp, s.step, axis=1),
      lengths=lengths,
      done=s.done | hit_stop | (lengths >= budgets),
      stopped=s.stopped | hit_stop,
      cache=new_cache,
      next_tokens=next_tokens,
      next_logprobs=next_logprobs,
      last_hidden=jnp.where(write[:, None], hidden, s.last_hidden),
      wrote=s.wrote | write)


# ----------------------------------------------------------------------------------------------------
# Convenience entry point.


def pad_rows(rows: Sequence[Sequence[int]], *, minimum: int = 16, maximum: int | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
  """`(tokens [B, W] int32, lengths [B] int32)`: `rows` right-padded with 0 to the next power of
  two `W >= ` the longest row (at least `minimum`, at most `maximum`): few distinct widths, few
  compilations of `prefill` / `extend`."""
  width = max(minimum, 1 << (max(max(len(r) for r in rows), 1) - 1).bit_length())
  width = width if maximum is None else min(width, maximum)
  tokens = np.zeros((len(rows), width), np.int32)
  lengths = np.array([len(r) for r in rows], np.int32)
  for i, r in enumerate(rows):
    tokens[i, :len(r)] = r
  return tokens, lengths


def generate(params, config: ModelConfig, prompts: Sequence[Sequence[int]],
             sampling: SamplingParams, seed: int = 0) -> list[tuple[list[int], np.ndarray]]:
  """Samples one completion per prompt (single turn).

  Prompts are right-padded to a power-of-two width; row `i` uses the key `fold_in(key(seed), i)`, so a
  prompt's completion depends on its index and the seed, not on the other prompts.

  Returns:
    One `(token_ids, logprobs)` per prompt: the sampled ids (a final stop token included) and their
    float32 log-probs (see `DecodeResult.logprobs`).
  """
  if not prompts:
    raise ValueError("generate needs at least one prompt.")
  rows = []
  for i, prompt in enumerate(prompts):
    ids = [int(t) for t in prompt]
    if not ids:
      raise ValueError(f"prompt {i} is empty; every prompt needs at least one token (e.g. BOS).")
    bad = [t for t in ids if not 0 <= t < config.vocab_size]
    if bad:
      raise ValueError(f"prompt {i} has token ids {bad[:5]} outside [0, vocab_size={config.vocab_size}).")
    rows.append(ids)
  tokens, lengths = pad_rows(rows)
  width = tokens.shape[1]
  params = family(config).prepare_decode_params(params, config)
  cache, last_logits = prefill(params, config, tokens, lengths, width + sampling.max_new_tokens)
  keys = per_row_keys(seed, np.arange(len(rows)))
  out = decode(params, config, cache, last_logits, keys, sampling)
  out_tokens, out_logprobs, out_lengths = jax.device_get((out.tokens, out.logprobs, out.lengths))
  return [(out_tokens[i, :n].tolist(), np.asarray(out_logprobs[i, :n], np.float32))
          for i, n in enumerate(out_lengths)]

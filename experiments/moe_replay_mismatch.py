r"""Train/rollout log-prob mismatch of a small random Qwen3-MoE with and without routing replay (R3).

    python experiments/moe_replay_mismatch.py [--updates=0,1,3] [--out=FILE.json]

The rollout side scores `--batch` random sequences with the KV-cache path in bfloat16 (the sampler's
numerics) and records each token's experts; the learner side scores them with the whole-sequence
pass in float32, recomputing the routing or replaying the recorded one, after `u` simulated updates
(each moves every parameter by `lr * sign(noise)`, an Adam-sized step; the behaviour side keeps
the version that sampled). The experts' gate/up projections are scaled up (x sqrt(30)) so that,
as in a trained MoE, experts differ and a token sent elsewhere gets other logits. Reports max and
mean |delta log p| of the scored tokens and the fraction of tokens whose top-k experts differ in
any layer (learner's recomputed routing against the rollout's).
"""

import json
import sys

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from longhorizon.models import Transformer, cached_forward, init_cache, init_params, tiny_config

_UPDATES = flags.DEFINE_list("updates", ["0", "1", "3"], "Simulated updates before scoring.")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences.")
_LENGTH = flags.DEFINE_integer("length", 64, "Tokens per sequence.")
_LR = flags.DEFINE_float("lr", 1e-3, "Per-parameter step of a simulated update.")
_OUT = flags.DEFINE_string("out", None, "Optional JSON path for the table.")


def _config():
  return tiny_config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, model_type="qwen3_moe",
                     qk_norm=True, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=64,
                     norm_topk_prob=True)


def _token_logp(logits, tokens):
  logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32)[:, :-1], axis=-1)
  return np.asarray(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0])


def _updated(params, steps: int, lr: float, seed: int = 7):
  for step in range(steps):
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + step), len(leaves))
    leaves = [x + lr * jnp.sign(jax.random.normal(k, x.shape)) for x, k in zip(leaves, keys)]
    params = jax.tree.unflatten(tree, leaves)
  return params


def main(argv):
  del argv
  config = _config()
  params = init_params(config, jax.random.key(0))
  for name in ("gate_proj", "up_proj"):
    params["layers"]["mlp"][name] = params["layers"]["mlp"][name] * np.sqrt(30.0)
  tokens = jax.random.randint(jax.random.key(1), (_BATCH.value, _LENGTH.value), 0, config.vocab_size)
  rollout = config.replace(dtype="bfloat16")
  sampled = cached_forward(params, rollout, tokens,
                           init_cache(rollout, _BATCH.value, _LENGTH.value), compute_logits=True)
  behaviour = _token_logp(sampled.logits, tokens)
  learner, rows = Transformer(config), []
  for updates in (int(u) for u in _UPDATES.value):
    current = _updated(params, updates, _LR.value)
    for replay in (False, True):
      out = learner.apply({"params": current}, tokens, routing=sampled.routing if replay else None)
      gap = np.abs(_token_logp(out.logits, tokens) - behaviour)
      recomputed = learner.apply({"params": current}, tokens).routing
      differs = np.any(np.sort(np.asarray(recomputed), -1) != np.sort(np.asarray(sampled.routing), -1),
                       axis=(-1, -2))
      rows.append(dict(updates=updates, replay=replay, max_abs=float(gap.max()),
                       mean_abs=float(gap.mean()), topk_differs=float(differs.mean())))
  print("| updates | routing | max abs dlogp | mean abs dlogp | tokens whose top-k differ |")
  print("|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['updates']} | {'replayed (R3)' if r['replay'] else 'recomputed'} | "
          f"{r['max_abs']:.4f} | {r['mean_abs']:.5f} | {r['topk_differs']:.3f} |")
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=1)


if __name__ == "__main__":
  app.run(main)

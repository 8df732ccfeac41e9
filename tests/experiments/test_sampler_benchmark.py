"""The sampler benchmark's roofline: its three weight layouts compute the same bare-matmul step.

Run in a subprocess: the benchmark script defines absl flags (`--out`, ...) that other benchmark
scripts imported by tests in the same process also define."""

import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).parents[2]

_CHECK = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import jax, jax.numpy as jnp, numpy as np
    import sampler
    from longhorizon.models import init_params, tiny_config
    config = tiny_config(num_hidden_layers=3)
    params = init_params(config, jax.random.key(0))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, config.hidden_size)), jnp.float32)
    outs = {}
    for name, (fn, layers, embedding) in sampler.roofline_inputs(params).items():
      logits, kvs = fn(x, layers, embedding)
      outs[name] = np.asarray(logits)
    assert sorted(outs) == ["fused", "scan", "unrolled"], sorted(outs)
    # A NumPy step through every layer's seven matmuls.
    a, m = params["layers"]["self_attn"], params["layers"]["mlp"]
    h = np.asarray(x, np.float64)
    for l in range(config.num_hidden_layers):
      w = lambda t: np.asarray(t["kernel"][l], np.float64)
      h = h + (h @ w(a["q_proj"])) @ w(a["o_proj"])
      h = h + ((h @ w(m["gate_proj"])) * (h @ w(m["up_proj"]))) @ w(m["down_proj"])
    ref = h @ np.asarray(params["embed_tokens"]["embedding"], np.float64).T
    for name, out in outs.items():
      np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5, err_msg=name)
    print("ROOFLINE_OK")
""")


def test_roofline_layouts_compute_the_same_step():
  proc = subprocess.run([sys.executable, "-c", _CHECK, str(ROOT / "experiments" / "benchmarks")],
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "ROOFLINE_OK" in proc.stdout

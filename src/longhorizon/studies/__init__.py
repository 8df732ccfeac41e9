"""Research studies and sweep launching, built on the training package.

`horizon`: the horizon-cliff study (end-to-end success versus horizon per credit-assignment
algorithm, from one shared warm start per environment, horizon and seed), run by
`experiments/horizon_sweep.py`. `sweeps`: override dicts beside a config (`get_sweep`), run names,
and a local subprocess runner of `experiments/train.py` commands, run by `experiments/sweep.py`.
"""

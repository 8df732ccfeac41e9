"""Plain-Python implementations of the environments: the speed baseline of `envs.py` (and a
second implementation the tests check the JAX environments against)."""

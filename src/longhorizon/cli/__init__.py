"""What the command-line entry points (`experiments/*.py`) share: `logs`, their console set-up.

Only the entry points import this package; library code never does (tests/test_import_graph.py).
"""

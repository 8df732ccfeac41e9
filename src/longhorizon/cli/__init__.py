"""What the command-line entry points (`experiments/*.py`) share: `logs`, their console set-up; and
`store`, an entry point of its own (`python -m longhorizon.cli.store WORKDIR`: the newest episodes
of a run's trajectory store).

Only the entry points import this package; library code never does (tests/test_import_graph.py).
"""

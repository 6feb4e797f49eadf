# The repros are scripts: importing one runs it (a Ray cluster, a W&B run). pytest would
# import them for --doctest-modules; tests/adapters/torchrl/test_repros.py runs them instead.
collect_ignore_glob = ["*.py"]

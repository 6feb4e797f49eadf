"""TorchRL's deviations from the contracts, one runnable script each (see deviations.py).

Each file is plain TorchRL code a maintainer can paste, ending in ``assert`` statements that
hold *because of* the deviation; ``posttrain.adapters.torchrl.deviations`` points at them,
``scripts/publish_torchrl_report.py`` prints them and ``tests/adapters/torchrl/test_repros.py`` runs them.
"""

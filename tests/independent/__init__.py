"""Implementations written from the specs alone, to test the conformance kit from outside.

Each module holds two correct designs per contract and plausible one-bug variants of them;
``tests/conformance/independent/test_buffer_loss_metrics_designs.py`` runs the kit on every one and records where its verdict and
the spec text disagree.
"""

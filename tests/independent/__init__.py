"""Implementations written from the specs alone, to test the conformance kit from outside.

Each module holds two correct designs per contract and plausible one-bug variants of them;
``tests/test_independent_a.py`` runs the kit on every one and records where its verdict and
the spec text disagree.
"""

"""Thin adapters that make framework components conform; each imports its framework lazily."""

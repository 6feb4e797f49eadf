"""posttrain: explicit, versioned contracts for the seams of LLM RL post-training.

Example:
    >>> import posttrain
    >>> posttrain.__version__
    '0.1.0'
"""

__version__ = "0.1.0"

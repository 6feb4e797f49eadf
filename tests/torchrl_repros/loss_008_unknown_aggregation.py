"""LOSS-008: an unknown aggregation silently falls back to token_mean, and misspelt keyword
arguments are swallowed by **kwargs.
"""

from torchrl.objectives.llm import GRPOLoss

loss = GRPOLoss(None, aggregation="token_meen", entropy_coef=0.5)  # typo'd value, typo'd keyword
assert loss.aggregation == "token_meen"  # kept as given; forward() then takes the token_mean branch
assert loss.entropy_coeff == 0.01  # the intended 0.5 went into **kwargs and was ignored

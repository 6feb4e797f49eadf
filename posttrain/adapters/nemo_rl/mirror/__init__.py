"""Code that mirrors NeMo-RL (NVIDIA-NeMo/RL, commit 7ea279a), for where ``nemo_rl`` cannot be installed.

Each module cites the upstream file and function it follows and is pinned by outputs of
NeMo-RL's own code (``tests/data/nemo_rl_*.json``). No module here imports an adapter
module: the adapters in :mod:`posttrain.adapters.nemo_rl` convert between posttrain's
contracts and NeMo-RL's formats, and use ``nemo_rl``'s own class instead of a mirror's where
``nemo_rl`` imports (:func:`posttrain.adapters.nemo_rl.upstream.nemo_rl_or_mirror`).

- :mod:`.batched_data_dict`: ``nemo_rl/distributed/batched_data_dict.py:BatchedDataDict``;
- :mod:`.batching`: its stacking rule, ``shard_by_batch_size`` and
  ``nemo_rl/data/llm_message_utils.py``'s message-log flattening;
- :mod:`.replay_buffer`: the rules of
  ``nemo_rl/algorithms/async_utils/replay_buffer.py:ReplayBufferImpl`` (sampling, staleness,
  restore);
- :mod:`.advantages`: ``nemo_rl/algorithms/advantage_estimator.py``'s estimators;
- :mod:`.loss_functions`: ``nemo_rl/algorithms/loss/loss_functions.py``'s
  ``ClippedPGLossConfig`` (onto posttrain's ``PolicyLossOptions``), ``ClippedPGLossFn``'s
  metrics and ``DPOLossConfig``'s keys.

Example:
    >>> from posttrain.adapters.nemo_rl.mirror.batched_data_dict import BatchedDataDict
    >>> BatchedDataDict({"x": [1, 2]}).size
    2
"""

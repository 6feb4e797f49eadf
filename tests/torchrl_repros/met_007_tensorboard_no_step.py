"""MET-007: every value logged without a step is stored at step 0 (SummaryWriter's default)."""

import tempfile

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torchrl.record.loggers.tensorboard import TensorboardLogger

d = tempfile.mkdtemp()
logger = TensorboardLogger(exp_name="x", log_dir=d)
for value in (0.5, 0.25, 0.125):
    logger.log_scalar("loss", value)  # no step: expected at 0, 1, 2
logger.experiment.close()
acc = EventAccumulator(logger.experiment.log_dir)
acc.Reload()
assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(0, 0.5), (0, 0.25), (0, 0.125)]

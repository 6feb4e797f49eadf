"""MET-007: a value logged without a step goes to the count of the name's values so far, not one
past its highest step: after step 5 it lands at step 1, back in time.
"""

import pathlib
import tempfile

from torchrl.record.loggers.csv import CSVLogger

d = tempfile.mkdtemp()
logger = CSVLogger(exp_name="x", log_dir=d)
logger.log_scalar("loss", 0.5, step=5)
logger.log_scalar("loss", 0.25)  # no step: expected at 6
(path,) = pathlib.Path(d).rglob("loss.csv")
assert path.read_text().split() == ["5,0.5", "1,0.25"], path.read_text()  # step 1

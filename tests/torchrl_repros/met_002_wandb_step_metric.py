"""MET-002: a metric named "step" or "<group>/step" is taken for a step counter: its value becomes
the step of its group and its own step is lost.
"""

import glob
import json
import subprocess
import sys
import tempfile

from torchrl.record.loggers.wandb import WandbLogger

d = tempfile.mkdtemp()
logger = WandbLogger(exp_name="x", offline=True, mode="offline", save_dir=d, log_env_packages=False)
logger.log_scalar("loss", 0.25, step=3)  # stored with its step in the column "step"
logger.log_scalar("step", 0.5, step=7)  # a metric named "step" (or "<group>/step")
logger.close()
(path,) = glob.glob(f"{d}/wandb/offline-run-*/run-*.wandb")
out = subprocess.run(
    [sys.executable, "-m", "wandb", "leet", "inspect", "--json", path],  # W&B's own reader
    capture_output=True,
    text=True,
    check=True,
).stdout
rows = [r["history"]["item"] for r in map(json.loads, out.splitlines()) if r["type"] == "history"]
rows = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
assert rows == [{"loss": 0.25, "step": 3}, {"step": 0.5}], rows  # 0.5 became a step; step 7 is lost

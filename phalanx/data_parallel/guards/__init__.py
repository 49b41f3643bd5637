"""What turns a silent data-parallel failure, or a DDP habit that trains wrong, into an error or a notice.

`checks.py`: ranks agree before the first step (`preflight_check`), replicas' buffers stay
identical (`check_replicas`), the loss is finite, and a synced backward is exchanged before it is used
(`UnsyncedGradientGuard`; a GradScaler's `unscale_` before the sum: `unscale.py`); `finite.py`:
the summed gradient's periodic NaN/Inf check, naming the step and the rank that went non-finite
first; `replicas.py`: the replicas' parameters and optimizers compared (a load or a scheduler step
made on one rank only); `step_extras.py`: what a synced step does after the sum (DDP's mean, running statistics
averaged by `running_stats.py`, the first step's look at the loop, `first_step.py`, and the
sizes shard_loss gets compared across the ranks at steps 1, 2, 4, ..., `sizes.py`). Imported
from the module that owns each name (nothing is re-exported here).
"""

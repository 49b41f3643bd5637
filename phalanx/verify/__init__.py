"""`phalanx verify`: does training on k devices equal training on 1, step by step - and if not, why?

The Python API is `verify(model_fn, data, loss_fn=..., config=VerifyConfig(...)) -> VerifyReport`
(api.py), usable on any model and loss; cli.py is the `phalanx verify` command built on it.
Inside: config.py (what a comparison runs), batches.py (global batches and example fingerprints),
run.py (the 1-device reference and one rank of the k-device run), compare.py (the numbers and the
verdict), diagnose.py (naming the culprit), report.py (text and JSON).
"""

from phalanx.verify.api import verify
from phalanx.verify.compare import Comparison, StepDiff, TensorDiff, compare_runs
from phalanx.verify.config import DEFAULT_TOLERANCE, LOSS_SCALES, VerifyConfig, scale_loss
from phalanx.verify.diagnose import Cause, Probe, ProbeResult
from phalanx.verify.report import VerifyReport, WorldResult


__all__ = ["Comparison", "StepDiff", "TensorDiff", "compare_runs", "DEFAULT_TOLERANCE", "LOSS_SCALES", "VerifyConfig", "scale_loss", "Cause", "Probe", "ProbeResult",
           "VerifyReport", "WorldResult", "verify"]

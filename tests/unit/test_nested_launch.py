"""A launch of workers inside a `phalanx run` worker is refused at the call (nested_launch.py),
here without any process: torch's starters raise before they start one. Lightning's own launchers
(a Trainer's or Fabric's strategy="ddp_spawn" or "ddp_fork" calls start_processes from its
package) get the fix a Lightning user can make, strategy="ddp"; any other caller the generic one. The refusal end to
end: tests/distributed/test_torchrun_dropin.py."""

import pytest
import torch.multiprocessing

from phalanx.errors import UsageError
from phalanx.runtime.main_module import Target
from phalanx.runtime.nested_launch import refusing_nested_launch

LIGHTNING = "/venv/lib/python3.11/site-packages/lightning/pytorch/strategies/launchers/multiprocessing.py"
FABRIC = "/venv/lib/python3.11/site-packages/lightning_fabric/strategies/launchers/multiprocessing.py"


def _caller_in(filename: str):
    """A function whose code lives in `filename`, calling start_processes as Lightning's launcher does."""
    namespace = {}
    exec(compile("def launch(mp):\n    mp.start_processes(print, args=(), nprocs=2, start_method='spawn')\n",
                 filename, "exec"), namespace)
    return namespace["launch"]


@pytest.mark.parametrize("filename, said", [
    (LIGHTNING, 'Lightning\'s strategy="ddp_spawn" (or "ddp_fork") would start its own workers under phalanx run, '
                'which starts the workers itself (its children would wait forever for a rendezvous): pass '
                'strategy="ddp" to the Trainer (or Fabric), which joins the workers `phalanx run --devices cpu:2 '
                'train.py` starts'),
    (FABRIC, 'Lightning\'s strategy="ddp_spawn" (or "ddp_fork") would start its own workers under phalanx run, '
             'which starts the workers itself (its children would wait forever for a rendezvous): pass '
             'strategy="ddp" to the Trainer (or Fabric), which joins the workers `phalanx run --devices cpu:2 '
             'train.py` starts'),
    ("/home/me/train_helpers.py", "torch.multiprocessing.start_processes would start 2 workers of the script's own "
                                  "under phalanx run, which starts the workers itself (its children would wait forever "
                                  "for a rendezvous): run it as `python train.py` (phalanx.init() in each child joins "
                                  "the group it opens), or drop the spawn and run `phalanx run --devices cpu:2 "
                                  "train.py`")])
def test_a_launch_inside_a_worker_is_refused_with_its_callers_fix(filename, said):
    with refusing_nested_launch(device_type="cpu", target=Target(name="/work/train.py")):
        with pytest.raises(UsageError) as refused:
            _caller_in(filename)(torch.multiprocessing)
    assert str(refused.value) == said
    assert torch.multiprocessing.start_processes.__module__ == "torch.multiprocessing.spawn"  # given back

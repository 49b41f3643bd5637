"""The `phalanx train` job: its config, one worker's run, outputs, directory locks, resume, restarts.

`config` (TrainConfig: every option of the command, validated), `job` (train_worker: data, model,
strategy, the epochs, the outputs), `step_hook` (what runs after each step: progress, lr schedule,
guards, mid-epoch checkpoints), `schedule` (lr warm-up), `resume` (where a run starts and what
must match), `outputs` (metrics.jsonl, accuracy.png, model.pt), `dirlock` (one run per output
directory), `elastic` (--max-restarts and --elastic). Built on the library in train/.
"""

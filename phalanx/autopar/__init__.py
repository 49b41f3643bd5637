"""D2L's "Automatic Parallelism" chapter as experiments: its two text experiments and five exercises.

`chapter` (`phalanx bench overlap`: two workloads alone and together; computing while
communicating), `exercises` (`phalanx bench autopar`: the five exercises), with `ops` (independent
products), `pipeline` (computation and communication at once), `trace` (the profiler), `graphs`,
`taskgraph`, `taskgraph_program` and `deps` (a task graph from a program's reads and writes, run by
a dependency-driven scheduler), `cuda` and `cuda_graph` (the same on a GPU's streams), `report`.
It knows nothing of data parallelism: it stands on the runtime and the measuring kit only.
"""

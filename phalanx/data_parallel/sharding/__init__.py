"""Sharded data parallelism (ZeRO stages 1-3): each rank keeps 1/k of the optimizer state, then of the
gradients, then of the parameters, and the update stays the 1-device update.

`stages.py` is the replica's sharded state and its reduce-scatters (`Sharding`, built by `DataParallel`
under `shard=`); `flat_layout.py` the one flat order and its cut into k ranges; `params.py` the
parameters flat per bucket, this rank's range kept; `at_rest.py` what a stage-3 parameter is between
steps; `gathered.py` `dp.gathered_parameters()`; `gather_hooks.py` stage 3's per-layer gathers;
`optim.py` `dp.optimizer(...)` over this rank's pieces (`torch_clip.py`: torch's clipping over the
replica's parameters refused); `state.py` a rank's share of the state as
ranges of the flat order, for checkpoints that any k reads. Imported from the module that owns each
name (nothing is re-exported here).
"""

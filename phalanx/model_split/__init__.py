"""The chapter's two other ways to split one network over k devices: by layers and by channels.

`pipeline` (+ `pipeline_comm`): stages of layers, micro-batches pipelined (GPipe or 1F1B);
`channels` (+ `channels_comm`): every layer's output channels split; `lenet_parts` cuts the
book's LeNet for both; `model_split` is what they share (the whole model from the shards);
`splits` names the three ways (`data`, `layers`, `channels`), checks and builds a split.
Each is a `Strategy` for the training loop (train/loop.py), as data parallelism's `DataSplit` is.
"""

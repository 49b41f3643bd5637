"""`phalanx predict`: how fast will this train on k devices, before you have them?

It profiles one device (forward, backward, optimizer, the moment each gradient bucket is ready),
takes the link's latency α and bandwidth β (measured over loopback here, or a preset, or
flags), and predicts the step time and images/s at each k with an α–β model of the chosen
allreduce and the bucketed overlap with backward (costmodel.py, timeline.py); `--validate`
measures phalanx at the same settings right after and prints the error. config.py holds what it
is asked (`PredictConfig`, its flags declared on its fields), run.py the prediction, report.py the
table and chart, cli.py the command. `--hosts H --link-gbit R` predicts H hosts instead, flat gloo
against the hierarchical allreduce (hosts.py).
"""

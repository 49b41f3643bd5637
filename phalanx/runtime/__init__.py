"""The process runtime: one worker process per device, and what they share below any collective.

`world` (who this process is: rank, world size, device; the only reader of launcher variables),
`devices` (--devices specs), `binding` (threads, core slices, the allocator), `lifeline` (workers
die with their launcher; signals; whole output lines), `procs` (what /proc says of a peer),
`supervise` (the one way worker processes start and are watched), `launch` (a local run as a
one-host torchrun job, or a torchrun job joined), `script` (`phalanx run` and `phalanx.init()`)
with what it runs (`main_module`: a file or a module as `__main__`), the other launchers' flags it
names (`launcher_flags`) and the torch errors it re-words (`script_errors`), `segment` (shared-memory segments and futexes) and `board` (each local rank's line: the
collective it is in, how its work ended). It imports nothing of phalanx above errors.
"""

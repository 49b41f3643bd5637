"""`python -m phalanx ...` (what `torchrun -m phalanx train` runs in every process)."""

from phalanx.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

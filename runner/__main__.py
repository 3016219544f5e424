"""`python -m runner ...` is the same as `mpt-run ...` (torchrun needs a module)."""
from runner.cli import main

main()

"""`python -m rlhf.cli`: the `rlhf` command without its console script."""

from rlhf.cli import main

main()

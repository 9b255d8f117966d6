"""Several `reward-lens` commands in one process (one start-up per rank under torchrun).

python -m torch.distributed.run --nproc_per_node 2 tests/torchrun_cli.py audit ... :: compare ...
"""

import sys

from reward_lens.app.cli import main

if __name__ == "__main__":
    groups, current = [], []
    for arg in sys.argv[1:]:
        if arg == "::":
            groups.append(current)
            current = []
        else:
            current.append(arg)
    groups.append(current)
    for argv in groups:
        rc = main(argv)
        if rc:
            sys.exit(rc)

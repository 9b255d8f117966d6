"""`python -m reward_lens ...` is `reward-lens ...`."""

import sys

from reward_lens.app.cli import main

sys.exit(main())

"""`python -m frugality ...`, as torchrun starts it: `torchrun --nproc_per_node 2 -m frugality train`."""

import sys

from frugality.cli import main

sys.exit(main())

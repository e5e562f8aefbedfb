"""``python -m unirl.cli ...``: the ``unirl`` command."""

import sys

from unirl.cli import main

sys.exit(main())

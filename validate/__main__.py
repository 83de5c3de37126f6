"""``python -m validate PLAN.json``: the same as the ``validate`` command (torchrun uses this form)."""

import sys

from validate.cli import main

sys.exit(main())

"""``python -m diffcheck`` (or ``diffcheck.cli``): the same as the ``diffcheck`` command."""

import sys

from diffcheck.cli import main

sys.exit(main())

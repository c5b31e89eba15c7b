"""``python -m constrained_spec``: the same as the ``constrained-spec`` command."""

import sys

from .cli import main

sys.exit(main())

"""``python -m constrained_spec``: the same as the ``constrained-spec`` command."""

from .cli import run

run()

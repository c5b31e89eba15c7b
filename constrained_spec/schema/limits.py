"""How far the schema compiler goes before it stops: nesting depths and regex sizes.

Read at call time (``limits.NESTING``, never ``from .limits import NESTING``), so that setting
``constrained_spec.schema.limits.NESTING`` takes effect."""

# (times a recursive $ref is expanded before it counts as false, nesting allowed inside
# free-form values ({} / true schemas)), tried in order until the regex fits MAX_REGEX_CHARS
NESTING = ((3, 2), (2, 1), (1, 0))
NESTING_BUDGET = 50_000  # regex characters; ~1-5 s of index build with a 49k-token vocabulary
MAX_BRANCHES = 256  # anyOf combinations distributed over one node
MAX_REGEX_CHARS = 2_000_000
MAX_NUMBER_BOUND = 10**9  # |minimum|, |maximum| for non-integer numbers (float rounding)
MAX_DEPTH = 64  # nested objects/arrays in a schema document (the checker recurses ~3 frames each)

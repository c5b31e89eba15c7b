"""Decoding: the policy and the exact acceptance rule (``sample``), the drafters (``drafters``,
the trained ``head``) and the one loop (``loop``: a request is a row of a batch, a round is one
``step``). It uses both lower layers: the constraint's masks and states, the target's logits."""

from .drafters import Draft, Drafter, model_drafter
from .head import DraftHead
from .loop import AdaptiveK, Round, Row, Stats, admit, decode, step
from .sample import SamplingConfig

__all__ = [
    "AdaptiveK",
    "Draft",
    "DraftHead",
    "Drafter",
    "Round",
    "Row",
    "SamplingConfig",
    "Stats",
    "admit",
    "decode",
    "model_drafter",
    "step",
]

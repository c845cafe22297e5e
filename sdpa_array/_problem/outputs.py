"""What a forward call returns beside its output, declared once.

The public functions turn their ``return_*`` flags into one :class:`Outputs` record at once
(as torch's ``varlen_attn`` takes an ``AuxRequest``); the planner and every forward kernel
take the record. A new output is a new field here.
"""

from __future__ import annotations

from dataclasses import dataclass

from .scalar_options import check_flag

__all__ = ["Outputs"]


@dataclass(frozen=True)
class Outputs:
    """The outputs a forward call asks for beside ``out``.

    Attributes
    ----------
    weights : bool
        The attention weights ``(..., Hq, L, S)``.
    lse : bool
        The log-sum-exp of each row's final scores ``(..., Hq, L)``.
    max_scores : bool
        The largest ``scale * q . k`` over the admissible pairs of each batch element and
        query head ``(..., Hq)``: before softcap, bias and dropout; ``-inf`` where there is
        none.
    """

    weights: bool = False
    lse: bool = False
    max_scores: bool = False

    @classmethod
    def of(
        cls, return_weights: object, return_lse: object, return_max_scores: object = False
    ) -> Outputs:
        """The record of the flags, each checked to be a bool."""
        check_flag("return_weights", return_weights)
        check_flag("return_lse", return_lse)
        check_flag("return_max_scores", return_max_scores)
        return cls(bool(return_weights), bool(return_lse), bool(return_max_scores))

    @property
    def flags(self) -> dict[str, bool]:
        """The public functions' keyword arguments that ask for these outputs."""
        return {
            "return_weights": self.weights,
            "return_lse": self.lse,
            "return_max_scores": self.max_scores,
        }

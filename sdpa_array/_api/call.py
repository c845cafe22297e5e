"""The argument handling the public entry points share: a call's arguments gathered once.

Each entry point reads ``arguments = locals()`` and hands it here:
:func:`direct_call` finds the kept direct call of a plain forward call (every option but
``is_causal``, ``scale`` and ``enable_gqa`` at its default); :meth:`Call.gather` checks the
layout and the output flags and gathers the options into their record, with what the call
asks of the planner (implementation, block sizes) and how to call the entry point again
(:meth:`Call.keywords`, for the heads-first views and the compiled JAX call).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .._plan import cache
from .._problem.options import Options
from .._problem.outputs import Outputs
from .layout import check_layout

__all__ = ["Call", "direct_call"]

#: Options whose default is ``None``, which a plain forward call leaves so.
_NONE_OPTIONS = (
    "mask",
    "bias",
    "window",
    "softcap",
    "query_lengths",
    "key_lengths",
    "segment_ids",
    "sinks",
    "dropout_seed",
    "mask_mod",
    "bias_mod",
    "score_mod",
    "block_q",
    "block_k",
)
#: The output flags, ``False`` in a plain forward call.
_FLAGS = ("return_weights", "return_lse", "return_max_scores")
#: Options of another default, each compared only with a value of the default's own type
#: (so that no array or other object is asked for its truth).
_VALUE_OPTIONS = (
    ("alignment", "top_left"),
    ("padding_side", "right"),
    ("dropout_p", 0.0),
    ("layout", "BHLE"),
)


def direct_call(arguments: Mapping[str, Any]) -> Callable[[Any, Any, Any], Any] | None:
    """The direct call kept for a forward call's ``arguments`` (its ``locals()``), where
    every option but ``is_causal``, ``scale`` and ``enable_gqa`` is at its default and the
    output alone is asked for; ``None`` otherwise."""
    for name in _NONE_OPTIONS:
        if arguments[name] is not None:
            return None
    for name in _FLAGS:
        if arguments[name] is not False:
            return None
    for name, default in _VALUE_OPTIONS:
        value = arguments[name]
        if type(value) is not type(default) or value != default:
            return None
    three = (arguments["is_causal"], arguments["scale"], arguments["enable_gqa"])
    query, key, value = arguments["query"], arguments["key"], arguments["value"]
    return cache.direct(query, key, value, three, arguments["implementation"])


@dataclass(frozen=True)
class Call:
    """One public call's arguments, checked and gathered.

    Attributes
    ----------
    options : Options
        The attention options.
    outputs : Outputs
        The outputs asked for beside ``out`` (forward calls; the defaults elsewhere).
    implementation : str
        The implementation asked for (the planner checks it).
    blocks : tuple of (int or None)
        ``(block_q, block_k)`` as given.
    layout : str
        ``"BHLE"`` or ``"BLHE"``, checked.
    others : dict
        The entry point's own keywords beside these (the VJP's saved forward, say), passed
        on when it is called again.
    """

    options: Options
    outputs: Outputs
    implementation: Any
    blocks: tuple[Any, Any]
    layout: str
    others: dict[str, Any]

    @classmethod
    def gather(
        cls, arguments: Mapping[str, Any], arrays: tuple[str, ...], others: tuple[str, ...] = ()
    ) -> Call:
        """The call of an entry point's ``arguments`` (its ``locals()``): the layout checked
        against the ``arrays`` named, the output flags checked where the entry point has
        them, the options gathered; ``others`` names its own keywords to keep."""
        check_layout(arguments["layout"], {name: arguments[name] for name in arrays})
        outputs = Outputs()
        if "return_weights" in arguments:
            flags = (arguments[name] for name in _FLAGS)
            outputs = Outputs.of(*flags)
        return cls(
            Options.gather(arguments),
            outputs,
            arguments["implementation"],
            (arguments["block_q"], arguments["block_k"]),
            arguments["layout"],
            {name: arguments[name] for name in others},
        )

    def keywords(self, **changes: Any) -> dict[str, Any]:
        """The keywords that call the entry point again (the layout aside), with
        ``changes``."""
        calls = {
            "implementation": self.implementation,
            "block_q": self.blocks[0],
            "block_k": self.blocks[1],
        }
        flags = self.outputs.flags if self.outputs != Outputs() else {}
        return {**self.options.keywords(), **flags, **calls, **self.others, **changes}

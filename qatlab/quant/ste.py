"""SteKind: which straight-through estimator maps gradients through a quantizer.

A quantizer's forward (round, clamp) has zero gradient almost everywhere; a
straight-through estimator (STE) replaces it with a surrogate. With ``g`` the
upstream gradient and ``u`` the input measured in units of the quantizer's range
(see :mod:`qatlab.quant`):

=================  ==========================================
IDENTITY           ``dx = g``
CLIPPED_IDENTITY   ``dx = g`` where the clamp did not act, else 0
TANH               ``dx = g * (1 - tanh(u)^2)``
HARD_TANH          ``dx = g * max(0, 1 - |u|)``
=================  ==========================================
"""
from __future__ import annotations

import enum
import json


class SteKind(str, enum.Enum):
    """The four straight-through estimators; the value is the JSON/string form."""

    IDENTITY = "identity"
    CLIPPED_IDENTITY = "clipped_identity"
    TANH = "tanh"
    HARD_TANH = "hard_tanh"

    @classmethod
    def _missing_(cls, value):
        if isinstance(value, str):
            for kind in cls:
                if kind.value == value.lower() or kind.name == value.upper():
                    return kind
        valid = ", ".join(repr(k.value) for k in cls)
        raise ValueError(f"ste: unknown SteKind {value!r}; valid kinds are {valid}")

    @property
    def code(self) -> int:
        """Small integer used by the Numba kernels (0..3, in declaration order)."""
        return _CODES[self]

    def __str__(self) -> str:
        return self.value

    def to_json(self) -> str:
        """JSON form: the quoted string value, e.g. ``'"tanh"'``."""
        return json.dumps(self.value)

    @classmethod
    def from_json(cls, text: str) -> "SteKind":
        """Inverse of :meth:`to_json`."""
        return cls(json.loads(text))


_CODES = {kind: i for i, kind in enumerate(SteKind)}
STE_NAMES = [k.value for k in SteKind]

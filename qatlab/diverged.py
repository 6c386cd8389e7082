"""NonFiniteError: a number training computed (loss, gradient, scale, parameter) is NaN or inf.

It is a ``ValueError``, as the engine's finiteness checks raised before, so code that caught
those keeps working; the training loop (:mod:`qatlab.train.trainer`) tells it apart from a
bug and ends the run as ``diverged`` with the quantity and the step named, not ``failed``.
"""
from __future__ import annotations


class NonFiniteError(ValueError):
    """``quantity``: what became non-finite, as a message shows it (e.g. ``"LSQ scale of layer 1"``),
    or None when the raiser cannot name it (an observer sees only its input); ``value``: what it
    became (a number, or a word such as ``"NaN or inf"``)."""

    def __init__(self, message: str, quantity: str | None = None, value="NaN or inf"):
        super().__init__(message)
        self.quantity, self.value = quantity, value

    def describe(self, step: int) -> str:
        """``"<quantity> became <value> at step <step>"`` (the message itself if no quantity)."""
        what = self.quantity if self.quantity is not None else str(self)
        value = f"{self.value:.4g}" if isinstance(self.value, float) else self.value
        return f"{what} became {value} at step {step}"

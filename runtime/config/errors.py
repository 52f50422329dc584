"""The error a request's bad input raises, naming the field to blame."""

from __future__ import annotations


class FieldError(ValueError):
    """Bad input that one field of a call is to blame for. `field` names it as the engine's
    API does (`inputs[2]`, `dimensions`), so a serving layer can name it in its own terms."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason

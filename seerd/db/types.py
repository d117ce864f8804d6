"""Column types shared by the models."""

from __future__ import annotations

import enum

from sqlalchemy import Enum


def status_column_type(enum_cls: type[enum.Enum]) -> Enum:
    # Stored as the enum's value in a short VARCHAR; no CHECK constraint so that adding a status
    # later is a one-line migration rather than a table rebuild.
    return Enum(
        enum_cls,
        native_enum=False,
        create_constraint=False,
        length=16,
        values_callable=lambda members: [m.value for m in members],
        validate_strings=True,
    )

"""The error every graph loader raises: a dataset name, file or split specification that cannot be used."""

from __future__ import annotations


class DatasetError(ValueError):
    """A dataset name, file or split specification cannot be used."""

"""The engine's start-up error: what the CLI prints as one line and exits 2 on. Its own
module so that what loads a model and what checks it (attention, quantisation) can
both raise it without importing each other."""

from __future__ import annotations


class ModelLoadError(Exception):
    """The model cannot be found or read; the message says what to do."""


class UnsupportedModelError(ModelLoadError):
    """The model needs something the engine cannot do; the message names it."""

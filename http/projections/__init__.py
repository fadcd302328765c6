"""Projections of the lifecycle event stream onto each API shape."""

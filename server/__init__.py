"""Sluice inference server."""

from sluice.core.paths import sole_name

sole_name(__name__, "sluice.server")

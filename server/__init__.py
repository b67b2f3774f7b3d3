"""Sluice inference server."""

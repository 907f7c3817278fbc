"""Mula."""

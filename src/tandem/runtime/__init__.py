"""Distributed runtime: discovery, request plane, event plane, lifecycle."""

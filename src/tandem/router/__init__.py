"""Routing: indexer, active-sequence tracking, cost function, policies, replica sync."""

"""Connectors: how the planner starts and drains workers (`base.Connector`)."""

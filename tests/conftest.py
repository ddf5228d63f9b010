"""Shared test fixtures. Port 0 everywhere; real etcd/nats-server come from the venv."""

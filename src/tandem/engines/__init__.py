"""Engines (mocker, native, adapters) and the Worker that hosts one."""

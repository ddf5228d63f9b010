"""Event plane backends (DESIGN.md §1): memory, zmq, nats; chosen by `make_event_bus`."""

"""The global router (DESIGN.md §11): sends each request to the pool that can meet its
latency target. `config` holds the grids, `app` the HTTP proxy in front of the pools."""

"""Benchmarks of tandem's own parts, each a `tandem bench <name>` subcommand: from one
structure or hook in one process (indexer, tracing, frontend-stages, mocker-path, structured,
engine, kvbm, transfer, multimodal, disagg) to whole tandem stacks (routers: one stack per router
mode; soak: RSS slope under mixed load; planner: the planner against static fleets)."""

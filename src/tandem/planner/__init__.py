"""The planner (DESIGN.md §11): reads worker step stats and frontend request stats from the
event plane, decides per pool (load mode or throughput mode) within min/max/budget/cooldowns,
and acts through a connector (in-process, local processes, Ray) with drain-safe scale-down.
The decision core (`planner.Planner`) is synchronous and deterministic; `service` is its
async edge. `global_router` maps requests to pools by latency target."""

"""KV block manager (DESIGN.md §9): host (G2) and disk (G3) tiers behind the engine's device pool.

`manager.BlockManager` offloads blocks in the background and onboards prefixes; `sim.
SimBlockManager` is its data-less twin for the mocker; `args` holds the `--kvbm-*` flags.
Engines wire them in: `tandem.engines.native.tiering.KvTiering` (offload on G1 eviction,
onboard at admission) and the mocker's `Scheduler` (`MockerConfig.kvbm`).
"""

"""The simulated world: a seeded GPU cluster with fault injection (`cluster`), the built-in
scheduler it runs its jobs under, and the scenario files that describe it (`scenario`,
`scenarios/*.yaml`).

The world is built by the wiring (`gpuvigil.app.runtime.build_simulated`, the demo, benchmarks) and
handed to `gpuvigil.collectors.simulated.SimulatedCollector`, which only reads it."""

"""Scale-out on NATS JetStream: `gpuvigil agent` (one per node), `gpuvigil detect` (job partitions
owned through KV leases) and `gpuvigil act` (one leader through a KV lease).

Same code, another transport: the agents and detect replicas run `pipeline.core.Pipeline` with the
detectors of `detectors.registry`; act runs a Pipeline with a detector that relays the findings the
others publish, plus the cluster-scope `fragmentation_cluster` over the agents' node summaries, so the findings lifecycle, the hint rules (`pipeline.hints`), the alert pusher and
outbox (`alerts.pusher`) and the hint store (`api.store`) are the ones `serve` runs. Only what
feeds the windows (rows from the stream) and what carries the findings (the findings stream)
change. The stream is the state: a replica that takes a partition rebuilds its windows by
replaying the partition's last `replay_seconds`, after restoring what a replay cannot rebuild (a
hang older than it, the findings' first reports) from the partition's snapshot in the state
bucket. docs/scale.md has the model and measurements.
"""

"""Pure text parsing shared by collectors, detectors and `analyze`: log and driver messages to
typed records, with no I/O and no polars frames.

- `oom`: CUDA out-of-memory messages -> `OomReport` (+ `load_oom_config` for its classifier)
- `nccl`: PyTorch / NCCL training-log lines -> `ParsedLog` (watchdog timeouts, progress, NCCL WARN, OOMs)
- `xid_line`: NVIDIA driver `NVRM: Xid` lines -> `XidLine`
- `logtime`: timestamps of log lines in the shapes GPU nodes write them

Depends only on the standard library, pydantic, `gpuvigil.config` and `gpuvigil.model`; a test
(tests/test_import_graph.py) keeps it so."""

"""dcgm-exporter: scrape its `/metrics` (or read a saved scrape) into `gpu_samples`.

dcgm-exporter publishes one Prometheus series per DCGM field and GPU, labelled with `gpu`
(index), `UUID`, `pci_bus_id`, `modelName`, `Hostname` (newer releases: `hostname`) and, when
it maps GPUs to workloads, `pod`/`namespace`/`container` (Kubernetes) or `hpc_job` (Slurm).
The text is parsed with prometheus_client's parser; the samples are pivoted to one row per GPU
with polars and mapped onto the `gpu_samples` schema (MiB → bytes, % → ratio) as the table of
gpuvigil/signals.py says. `frames_from_long` does the mapping and reads the labels: `gpuvigil
replay` calls it on the same series read back from Prometheus or files, so a replayed history
gives the frames (and the job map) the live collector gave.

`DCGM_FI_DEV_XID_ERRORS` is the *last* XID the GPU raised, not a count: a change of its value
is a new XID, which the collector turns into an `events` row and counts in `xid_total`.

Streams: `gpu_samples`, `events` (new XIDs), and `gpu_workloads` (which pod/job uses which
GPU, from the labels). `parse_text` also returns `dcgm_extra` (fields with no `gpu_samples`
column, e.g. energy), which no detector reads: the collector does not send it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import polars as pl
from prometheus_client.parser import text_string_to_metric_families

from gpuvigil import schemas, signals
from gpuvigil.errors import UserError

MIB = 1 << 20

GPU_WORKLOADS = schemas.GPU_WORKLOADS

DCGM_EXTRA = pl.Schema(
    {
        "ts": pl.Float64,
        "node": pl.Utf8,
        "gpu": pl.Int32,
        "gpu_uuid": pl.Utf8,
        "total_energy_mj": pl.Float64,
        "memory_temperature_c": pl.Float64,
        "pcie_tx_kb_total": pl.Float64,
        "pcie_rx_kb_total": pl.Float64,
        "nvlink_bandwidth_total": pl.Float64,
        "fb_reserved_bytes": pl.Int64,
    }
)

# What the collector sends the pipeline. `dcgm_extra` (energy, memory temperature, ...) is read by
# no detector or sink, so a scrape's is returned by `parse_text` (for tools) but not kept.
STREAMS: Mapping[str, pl.Schema] = {
    "gpu_samples": schemas.GPU_SAMPLES,
    "events": schemas.EVENTS,
    "gpu_workloads": GPU_WORKLOADS,
}

# Column <- the labels that carry it, the first present and non-empty wins. dcgm-exporter names
# the host `Hostname` (newer releases `hostname`); gpuvigil's own series say `node`; a series
# with neither falls back on Prometheus' `instance`. Where the scrape configuration attaches its
# own `pod`/`namespace`/`container` target labels (kube-prometheus without honorLabels),
# Prometheus keeps dcgm-exporter's as `exported_pod`, ...: those name the workload.
LABELS: Mapping[str, tuple[str, ...]] = {
    "node": ("Hostname", "hostname", "node", "instance"),
    "gpu": ("gpu",),
    "gpu_uuid": ("UUID", "gpu_uuid"),
    "model_name": ("modelName",),
    "pci_bus_id": ("pci_bus_id",),
    "pod": ("exported_pod", "pod"),
    "namespace": ("exported_namespace", "namespace"),
    "container": ("exported_container", "container"),
    "hpc_job": ("hpc_job",),
}
_KEY = ["ts", "node", "gpu", "gpu_uuid"]
_ATTRIBUTION = ["model_name", "pci_bus_id", "pod", "namespace", "container", "hpc_job"]

# Fields with no `gpu_samples` column, kept in `dcgm_extra`.
_EXTRA_FIELDS = (
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
    "DCGM_FI_DEV_MEMORY_TEMP",
    "DCGM_FI_DEV_PCIE_TX_THROUGHPUT",
    "DCGM_FI_DEV_PCIE_RX_THROUGHPUT",
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
)
# Every DCGM field mapped: the `gpu_samples` columns' (gpuvigil/signals.py), then the extra ones.
FIELDS_USED = tuple(dict.fromkeys((*signals.DCGM_FIELDS, *_EXTRA_FIELDS)))
_FIELD_SET = frozenset(FIELDS_USED)


def label_values(labels: Mapping[str, str]) -> dict[str, str | None]:
    """A series' labels -> the columns of `LABELS` (null where no label names it)."""
    return {col: next((v for n in names if (v := labels.get(n))), None) for col, names in LABELS.items()}


def _f(name: str) -> pl.Expr:
    return pl.col(name)


def _wide(long: pl.DataFrame) -> pl.DataFrame:
    """Long DCGM samples (ts, metric, value and the `LABELS` columns) -> one row per GPU and
    time with a Float64 column per DCGM field (all of `FIELDS_USED`, null where absent) and the
    attribution labels. One GPU is (node, gpu): a UUID label present on some of its series only
    does not split it."""
    strings = [c for c in ("node", "gpu_uuid", *_ATTRIBUTION) if c in long.columns]
    long = long.with_columns(
        *[pl.when(pl.col(c) != "").then(pl.col(c)).alias(c) for c in strings],
        *[pl.lit(None, pl.Utf8).alias(c) for c in ("node", "gpu", "gpu_uuid", *_ATTRIBUTION) if c not in long.columns],
    ).with_columns(pl.col("gpu").cast(pl.Int32, strict=False))
    long = long.with_columns(pl.coalesce("gpu_uuid", pl.col("gpu_uuid").drop_nulls().first().over(["node", "gpu"])).alias("gpu_uuid"))
    wide = long.pivot(on="metric", index=_KEY, values="value", aggregate_function="first")
    missing = [pl.lit(None, pl.Float64).alias(n) for n in FIELDS_USED if n not in wide.columns]
    wide = wide.with_columns(missing)
    labelled = [c for c in _ATTRIBUTION if long.get_column(c).null_count() < long.height]
    if labelled:
        # dcgm-exporter puts a GPU's workload labels on each of its series; the first that has one
        attribution = long.group_by(_KEY, maintain_order=True).agg([pl.col(c).drop_nulls().first().alias(c) for c in labelled])
        wide = wide.join(attribution, on=_KEY, how="left", nulls_equal=True)
    wide = wide.with_columns([pl.lit(None, pl.Utf8).alias(c) for c in _ATTRIBUTION if c not in labelled])
    return wide.sort(["ts", "node", "gpu"], nulls_last=True, maintain_order=True)


def frames_from_long(long: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """(gpu_samples, gpu_workloads, dcgm_extra) from dcgm-exporter's samples in long form, one
    row per GPU and time: the mapping of a live scrape and of a replayed history alike.

    `long`: ts, metric (the DCGM field name; counters without `_total`), value (DCGM's unit) and
    the label columns of `LABELS` (strings, as `label_values` gives them). Fields follow
    gpuvigil/signals.py. `xid_total` is left null: only whoever watches successive samples of a
    GPU can count its XIDs."""
    if long.is_empty():
        return schemas.empty("gpu_samples"), schemas.empty("gpu_workloads"), pl.DataFrame(schema=DCGM_EXTRA)
    wide = _wide(long.filter(pl.col("metric").is_in(FIELDS_USED)))
    samples = wide.select(pl.col("ts"), pl.col("node"), pl.col("gpu"), pl.col("gpu_uuid"), *signals.dcgm_expressions(FIELDS_USED))
    workloads = wide.select(GPU_WORKLOADS.names())
    extra = wide.select(
        pl.col("ts"),
        pl.col("node"),
        pl.col("gpu"),
        pl.col("gpu_uuid"),
        _f("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION").alias("total_energy_mj"),
        _f("DCGM_FI_DEV_MEMORY_TEMP").alias("memory_temperature_c"),
        _f("DCGM_FI_DEV_PCIE_TX_THROUGHPUT").alias("pcie_tx_kb_total"),
        _f("DCGM_FI_DEV_PCIE_RX_THROUGHPUT").alias("pcie_rx_kb_total"),
        _f("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL").alias("nvlink_bandwidth_total"),
        (_f("DCGM_FI_DEV_FB_RESERVED") * MIB).round(0).cast(pl.Int64).alias("fb_reserved_bytes"),
    )
    return (
        schemas.conform(samples, schemas.GPU_SAMPLES, stream="gpu_samples"),
        schemas.conform(workloads, GPU_WORKLOADS, stream="gpu_workloads"),
        schemas.conform(extra, DCGM_EXTRA, stream="dcgm_extra"),
    )


# The labels that name a workload (model and PCI address only describe the GPU).
_JOB_LABELS = ("pod", "namespace", "container", "hpc_job")


def workload_changes(workloads: pl.DataFrame, named_before: dict[tuple[Any, Any], bool]) -> pl.DataFrame:
    """The rows of `gpu_workloads` the job map needs: each row that names a workload, and a GPU's
    first row naming none after one that did (its workload ended, so the map drops it). A GPU
    that never ran a labelled workload sends nothing, so a fleet without job labels costs the
    pipeline no map at all. `named_before` ((node, gpu) -> whether the GPU's latest row seen
    earlier named a workload) carries this across scrapes or chunks; it is updated."""
    if workloads.is_empty() or (not any(named_before.values()) and all(workloads.get_column(c).null_count() == workloads.height for c in _JOB_LABELS)):
        return workloads.clear()  # no workload now nor before: nothing for the map
    named = pl.any_horizontal([pl.col(c).is_not_null() for c in _JOB_LABELS])
    df = workloads.with_columns(named.alias("_named")).sort(["node", "gpu", "ts"], nulls_last=True, maintain_order=True)
    earlier = pl.col("_named").shift(1).over(["node", "gpu"])
    if named_before:
        carried = pl.DataFrame(
            [{"node": k[0], "gpu": k[1], "_carried": v} for k, v in named_before.items()], schema={"node": pl.Utf8, "gpu": pl.Int32, "_carried": pl.Boolean}
        )
        df = df.join(carried, on=["node", "gpu"], how="left", nulls_equal=True)
        earlier = pl.coalesce(earlier, pl.col("_carried"))
    df = df.filter(pl.col("_named") | earlier.fill_null(False))
    for node, gpu, last in workloads.with_columns(named.alias("_named")).group_by(["node", "gpu"]).agg(pl.col("_named").sort_by("ts").last()).iter_rows():
        named_before[(node, gpu)] = bool(last)
    return df.select(GPU_WORKLOADS.names()).sort(["ts", "node", "gpu"], nulls_last=True, maintain_order=True)


def _relevant_lines(text: str) -> str:
    """Only the series (and their # HELP/# TYPE) of the fields we map.

    prometheus_client's parser costs ~0.5 ms per sample on a small CPU, and dcgm-exporter with
    profiling (DCP) fields enabled publishes many fields we do not use; dropping them first keeps
    a node's scrape cheap. Anything malformed among the kept lines still reaches the parser.
    """
    kept = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE") and parts[2] not in _FIELD_SET:
                continue
        elif line.strip():
            words = line.split("{", 1)[0].split(None, 1)
            name = words[0] if words else ""
            if name.startswith("DCGM_FI_") and name not in _FIELD_SET and name.removesuffix("_total") not in _FIELD_SET:
                continue
        kept.append(line)
    return "\n".join(kept) + "\n"


_LONG = pl.Schema({"ts": pl.Float64, "metric": pl.Utf8, "value": pl.Float64, **dict.fromkeys(LABELS, pl.Utf8)})


def parse_text(text: str, *, ts: float, default_node: str | None = None) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """(gpu_samples, gpu_workloads, dcgm_extra) from one Prometheus text exposition.

    Raises ValueError for text that is not a Prometheus exposition. `xid_total` is left null
    here: only a collector that watches successive scrapes can count XIDs.
    """
    rows: list[dict[str, Any]] = []
    for family in text_string_to_metric_families(_relevant_lines(text)):
        for sample in family.samples:
            name = sample.name
            # prometheus_client names counter samples `<family>_total`; DCGM's names are the family's.
            if name not in _FIELD_SET and name.endswith("_total") and name[: -len("_total")] in _FIELD_SET:
                name = name[: -len("_total")]
            if name not in _FIELD_SET:
                continue
            rows.append({"ts": ts, "metric": name, "value": float(sample.value), **label_values(sample.labels)})
    long = pl.DataFrame(rows, schema=_LONG, orient="row")
    if default_node is not None:
        long = long.with_columns(pl.col("node").fill_null(pl.lit(default_node, pl.Utf8)))
    return frames_from_long(long)


def looks_like_dcgm_scrape(sample: str) -> bool:
    return "DCGM_FI_" in sample


class DcgmCollector:
    """Scrapes every dcgm-exporter endpoint (one per node) on each `collect`, concurrently.

    One shared `httpx.AsyncClient` on a background event loop serves all endpoints (connections
    are kept alive between ticks); each scrape has its own deadline (`timeout_seconds`, for the
    whole request), so a dead or slow node costs the tick at most that long, not that long per
    node. At most `max_concurrency` scrapes are in flight; bodies over `max_bytes` are refused.
    Failures are counted and reported per endpoint by `health()`, never raised.
    """

    streams: Mapping[str, pl.Schema] = STREAMS

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        node: str | None = None,
        timeout_seconds: float = 2.0,
        max_concurrency: int = 64,
        max_bytes: int = 64 << 20,
    ):
        self.urls = [urls] if isinstance(urls, str) else list(dict.fromkeys(urls))
        if not self.urls:
            raise ValueError("DcgmCollector needs at least one dcgm-exporter URL")
        self.url = self.urls[0]
        self.name = f"dcgm:{self.url}" if len(self.urls) == 1 else "dcgm"
        self.errors = 0
        self.node = node
        self.timeout_seconds = timeout_seconds
        self.max_concurrency = max_concurrency
        self.max_bytes = max_bytes
        self.last_errors: dict[str, str | None] = {u: None for u in self.urls}
        self._last_xid: dict[str, pl.DataFrame] = {}  # per endpoint: node, gpu_uuid, prev_xid, xid_total
        self._named: dict[str, dict[tuple[Any, Any], bool]] = {}  # per endpoint: workload_changes' state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: httpx.AsyncClient | None = None
        self._sem: asyncio.Semaphore | None = None

    @property
    def last_error(self) -> str | None:
        """The latest failure of any endpoint this tick (None when all answered)."""
        return next((e for e in self.last_errors.values() if e), None)

    def health(self) -> dict[str, str | None]:
        return dict(self.last_errors)

    def describe(self) -> str:
        return f"dcgm-exporter: {len(self.urls)} endpoint(s) ({', '.join(self.urls[:3])}{', ...' if len(self.urls) > 3 else ''}), {self.timeout_seconds:g} s each"

    # -- the event loop ---------------------------------------------------------------------

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is not None:
            return self._loop
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="gpuvigil-dcgm", daemon=True)
        thread.start()

        async def setup() -> None:
            limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_seconds), limits=limits)
            self._sem = asyncio.Semaphore(self.max_concurrency)

        asyncio.run_coroutine_threadsafe(setup(), loop).result()
        self._loop, self._thread = loop, thread
        return loop

    def close(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return
        if self._client is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._client.aclose(), loop).result(timeout=5)
            except Exception:  # noqa: BLE001 - closing: nothing useful to do
                pass
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=5)
        loop.close()

    async def _get(self, url: str) -> str:
        assert self._client is not None
        async with self._client.stream("GET", url) as resp:
            resp.raise_for_status()
            chunks, size = [], 0
            async for chunk in resp.aiter_bytes():
                size += len(chunk)
                if size > self.max_bytes:
                    raise ValueError(f"scrape larger than {self.max_bytes} bytes")
                chunks.append(chunk)
            return b"".join(chunks).decode(resp.encoding or "utf-8", errors="replace")

    async def _fetch(self, url: str) -> tuple[str | None, str | None]:
        assert self._sem is not None
        async with self._sem:  # the deadline starts when the scrape does, not while it queues
            try:
                return await asyncio.wait_for(self._get(url), self.timeout_seconds), None
            except TimeoutError:
                return None, f"no complete answer within {self.timeout_seconds:g} s"
            except httpx.HTTPStatusError as exc:
                return None, f"HTTP {exc.response.status_code} from {url}"
            except (httpx.HTTPError, ValueError, OSError) as exc:
                return None, f"{type(exc).__name__}: {exc}"

    async def _fetch_all(self) -> list[tuple[str | None, str | None]]:
        return await asyncio.gather(*(self._fetch(u) for u in self.urls))

    def _scrape_all(self) -> list[tuple[str | None, str | None]]:
        loop = self._ensure_loop()
        rounds = -(-len(self.urls) // self.max_concurrency)
        fut = asyncio.run_coroutine_threadsafe(self._fetch_all(), loop)
        return fut.result(timeout=rounds * self.timeout_seconds + 10)

    # -- Collector protocol -----------------------------------------------------------------

    def collect(self, now: float) -> dict[str, pl.DataFrame]:
        parts: dict[str, list[pl.DataFrame]] = {k: [] for k in STREAMS}
        for url, (text, error) in zip(self.urls, self._scrape_all(), strict=True):
            if text is not None:
                try:
                    samples, workloads, _extra = parse_text(text, ts=now, default_node=self.node)
                except (ValueError, TypeError, schemas.SchemaError, pl.exceptions.PolarsError) as exc:
                    error = f"unparseable scrape: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                else:
                    samples, new_xids = self._track_xids(url, samples, now)
                    parts["gpu_samples"].append(samples)
                    workloads = workload_changes(workloads, self._named.setdefault(url, {}))
                    if workloads.height:
                        parts["gpu_workloads"].append(workloads)
                    if new_xids.height:
                        parts["events"].append(new_xids)
            if error is not None:
                self.errors += 1
            self.last_errors[url] = error
        return {k: (v[0] if len(v) == 1 else pl.concat(v, how="vertical_relaxed")) for k, v in parts.items() if v}

    def _track_xids(self, url: str, samples: pl.DataFrame, now: float) -> tuple[pl.DataFrame, pl.DataFrame]:
        """Count a new XID whenever a GPU's last XID changes (including from none to one)."""
        cur = samples.select("node", "gpu_uuid", "gpu", "last_xid")
        prev = self._last_xid.get(url)
        if prev is None:
            prev = pl.DataFrame(schema={"node": pl.Utf8, "gpu_uuid": pl.Utf8, "prev_xid": pl.Int32, "xid_total": pl.Int64})
        joined = cur.join(prev.select("node", "gpu_uuid", "prev_xid", "xid_total"), on=["node", "gpu_uuid"], how="left", nulls_equal=True)
        changed = pl.col("last_xid").is_not_null() & (pl.col("prev_xid").is_null() | (pl.col("last_xid") != pl.col("prev_xid")))
        joined = joined.with_columns(changed.alias("new"), (pl.col("xid_total").fill_null(0) + changed.cast(pl.Int64)).alias("xid_total"))
        self._last_xid[url] = joined.select("node", "gpu_uuid", pl.col("last_xid").alias("prev_xid"), "xid_total")
        samples = samples.drop("xid_total").join(joined.select("node", "gpu_uuid", "xid_total"), on=["node", "gpu_uuid"], how="left", nulls_equal=True)
        samples = schemas.conform(samples, schemas.GPU_SAMPLES, stream="gpu_samples")
        return samples, _xid_events(joined.filter(pl.col("new")), now)


def _xid_events(changed: pl.DataFrame, now: float) -> pl.DataFrame:
    """One `xid` event per row of `changed` (node, gpu, last_xid): its GPU's last XID changed."""
    events = changed.select(
        pl.lit(now, pl.Float64).alias("ts"),
        "node",
        "gpu",
        pl.lit("dcgm").alias("source"),
        pl.lit("xid").alias("kind"),
        pl.col("last_xid").alias("xid"),
        pl.format("XID {} reported by dcgm-exporter (DCGM_FI_DEV_XID_ERRORS)", pl.col("last_xid")).alias("message"),
    )
    return schemas.conform(events, schemas.EVENTS, stream="events")


def scrape_xid_events(samples: pl.DataFrame, xid_counters: Iterable[Mapping[str, Any]] = (), *, ts: float, default_node: str | None = None) -> pl.DataFrame:
    """The `xid` events one saved scrape holds: each GPU's last XID, as the collector reports it
    from its first scrape of an exporter (when it happened is not in the scrape: `ts`), and the
    codes of XID counters that label them (`xid="42"`, `DCGM_EXP_XID_ERRORS_COUNT`; read by
    `parsers.nvidia_smi.xid_counter_samples`), one per GPU and code."""
    last = _xid_events(samples.filter(pl.col("last_xid").is_not_null()), ts)
    rows = []
    for s in xid_counters:
        if not 0 <= s["xid"] < 1 << 31:  # no XID code is that large: a forged series
            continue
        labels = s["labels"]
        gpu = labels.get("gpu", "")
        rows.append({
            "ts": ts,
            "node": labels.get("Hostname") or labels.get("hostname") or default_node,
            "gpu": int(gpu) if gpu.isdigit() and int(gpu) < 1 << 31 else None,
            "source": "dcgm",
            "kind": "xid",
            "xid": s["xid"],
            "message": f"{s['metric']}{{xid=\"{s['xid']}\"}} = {s['value']:g} on the saved scrape",
        })
    if not rows:
        return last
    counted = schemas.frame(rows, schemas.EVENTS).unique(["node", "gpu", "xid"], keep="first", maintain_order=True)
    return pl.concat([last, counted], how="vertical_relaxed")


def read_scrape(path: str | Path, *, ts: float | None = None, default_node: str | None = None) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """A saved scrape file; the file's modification time stands for the scrape time."""
    p = Path(path)
    try:
        text = p.read_text(errors="replace")
        ts = p.stat().st_mtime if ts is None else ts
    except OSError as exc:
        raise UserError(f"{p}: cannot read: {exc.strerror or exc}") from exc
    try:
        return parse_text(text, ts=ts, default_node=default_node)
    except (ValueError, TypeError, pl.exceptions.PolarsError) as exc:
        raise UserError(f"{p}: not a Prometheus text exposition: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc


def scrape_once(url: str, *, timeout_seconds: float = 2.0) -> str:
    """Fetch one scrape (used by tools; the collector counts errors instead of raising)."""
    try:
        resp = httpx.get(url, timeout=timeout_seconds)
        resp.raise_for_status()
    except httpx.HTTPError as exc:
        raise UserError(f"{url}: scrape failed: {exc}") from exc
    return resp.text


__all__ = ["DcgmCollector", "scrape_xid_events", "GPU_WORKLOADS", "DCGM_EXTRA", "LABELS", "STREAMS", "frames_from_long", "label_values", "workload_changes", "parse_text", "read_scrape", "looks_like_dcgm_scrape"]

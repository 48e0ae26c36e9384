"""Kubernetes adapter: apply gpuvigil hints through the official `kubernetes` client.

| hint | API calls |
| --- | --- |
| cordon_node | read node; patch `spec.unschedulable=true` + annotation `gpuvigil.io/cordoned-by=<finding>`; taint `gpuvigil.io/<kind>=<finding>:NoSchedule`; node status condition `GpuvigilHealthy=False` |
| drain_node | the same, with the taint effect configured for the finding kind (xid, ecc, row_remap_failure: NoExecute, which evicts pods that do not tolerate it), and policy/v1 Evictions for the hint's job's pods on the node |
| requeue_job | Evictions for the job's pods on the bad node(s) (the Job controller recreates them; the taint keeps them off), and the `gpuvigil.io/verdict` annotation on the batch/v1 Job (or its pods) |
| set_alloc_conf, resize_or_move_job, compact | the `gpuvigil.io/verdict` annotation on the Job: the recommendation for its owner/operator |
| avoid_gpu | node annotation `gpuvigil.io/avoid-gpus` (GPU indices, for a device plugin or DRA driver to honour) |
| cause cleared (every cause quiet for the hold-down, check passed) | remove our taint, uncordon if *we* cordoned (annotation matches), condition back to True |
| quarantine state change | node annotation `gpuvigil.io/quarantine` (state, since, causes, finding ids) and an Event on the node |

Jobs are named `namespace/name` (or `name` in the configured default namespace); their pods are
found by the `job-name` label (configurable). A failed call raises `KubernetesError` with the
verb, path and status; through a store the hint stays pending with the error (see
`gpuvigil.scheduler.apply`). The RBAC these calls need is in docs/kubernetes-rbac.md and
deploy/rbac.yaml.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from gpuvigil import config
from gpuvigil.scheduler.apply import ApplyError, Plan, Step, Unsupported
from gpuvigil.model import Hint, HintAction

DOMAIN = "gpuvigil.io"
ANNOTATION_VERDICT = f"{DOMAIN}/verdict"
ANNOTATION_CORDONED_BY = f"{DOMAIN}/cordoned-by"
ANNOTATION_AVOID_GPUS = f"{DOMAIN}/avoid-gpus"
ANNOTATION_QUARANTINE = f"{DOMAIN}/quarantine"
STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"

Effect = Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]


class KubernetesConfig(BaseModel):
    # A hint whose apply failed is retried after retry_base_seconds, doubling up to retry_max_seconds.
    retry_base_seconds: float = Field(5.0, ge=0)
    retry_max_seconds: float = Field(300.0, ge=0)
    taint_effect: dict[str, Effect] = Field(default_factory=lambda: {"default": "NoSchedule", "xid": "NoExecute", "ecc": "NoExecute", "row_remap_failure": "NoExecute"})
    condition_type: str = Field("GpuvigilHealthy", pattern=r"^[A-Za-z][A-Za-z0-9]*$")
    job_label: str = Field("job-name", min_length=1)
    default_namespace: str = Field("default", min_length=1)
    request_timeout_seconds: float = Field(20.0, gt=0)
    field_manager: str = "gpuvigil"


def kubernetes_config(cfg: dict[str, Any] | None = None) -> KubernetesConfig:
    cfg = config.defaults() if cfg is None else cfg
    return config.section("api.kubernetes", KubernetesConfig, {"api.kubernetes": cfg.get("api", {}).get("kubernetes", {})})


class KubernetesError(ApplyError):
    """A Kubernetes API call failed; the message names the call and the API's answer."""


class KubernetesUnsupported(KubernetesError, Unsupported):
    """The hint has nothing to act on in Kubernetes terms (nacked with this reason)."""


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _camel(kind: str) -> str:
    return "".join(part.capitalize() for part in kind.split("_"))


class KubernetesAdapter:
    """Applies hints to a Kubernetes cluster: `plan(hint)` says which API calls, `apply(hint)`
    runs that plan; `gpuvigil.app.acting.Acting` decides what to apply and when to undo it.
    `connect=False` builds a planner only (`--act dry-run`: no client library, no credentials)."""

    def __init__(self, api_client: Any = None, *, store: Any = None, cfg: dict[str, Any] | None = None, connect: bool = True):
        self.config = kubernetes_config(cfg)
        self.store = store
        self.client = self.core = self.batch = None
        if not connect:
            return
        from gpuvigil.util.extras import require

        # The client is an extra (gpuvigil[kubernetes]); nothing imports it before an adapter starts.
        client = require("kubernetes.client", "the Kubernetes adapter")
        if api_client is None:
            api_client = self._default_client()
        self.client = client
        self.core = client.CoreV1Api(api_client)
        self.batch = client.BatchV1Api(api_client)

    @staticmethod
    def _default_client() -> Any:
        from kubernetes import client
        from kubernetes import config as kconfig

        try:
            kconfig.load_incluster_config()
        except kconfig.ConfigException:
            try:
                kconfig.load_kube_config()
            except (kconfig.ConfigException, OSError) as exc:
                raise KubernetesError(f"no Kubernetes credentials: not in a pod and no kubeconfig ({exc})") from exc
        return client.ApiClient()

    # -- plumbing ----------------------------------------------------------------------------
    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException, OpenApiException

        try:
            return fn(*args, _request_timeout=self.config.request_timeout_seconds, **kwargs)
        except ApiException as exc:
            detail = exc.reason or ""
            if exc.body:
                try:
                    detail = json.loads(exc.body).get("message") or detail
                except (ValueError, AttributeError):
                    pass
            raise KubernetesError(f"{what}: HTTP {exc.status} {detail}".rstrip()) from exc
        except OpenApiException as exc:
            raise KubernetesError(f"{what}: {exc}") from exc
        except OSError as exc:  # urllib3 connection errors derive from OSError
            raise KubernetesError(f"{what}: cannot reach the API server: {exc}") from exc
        except Exception as exc:
            if type(exc).__module__.startswith("urllib3"):
                raise KubernetesError(f"{what}: cannot reach the API server: {exc}") from exc
            raise

    def split_job(self, job: str | None) -> tuple[str, str]:
        if not job:
            raise KubernetesUnsupported("the hint names no job")
        ns, _, name = job.rpartition("/")
        ns = ns or self.config.default_namespace
        for part in (ns, name):
            if not re.match(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", part):
                raise KubernetesError(f"not a Kubernetes namespace/name: {job!r}")
        return ns, name

    @staticmethod
    def _check_node(node: str | None) -> str:
        if not node or not re.match(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", node):
            raise KubernetesError(f"not a Kubernetes node name: {node!r}")
        return node

    # -- node primitives --------------------------------------------------------------------
    def read_node(self, node: str) -> Any:
        return self._call(f"read node {node}", self.core.read_node, self._check_node(node))

    def cordon(self, node: str, finding_id: str) -> bool:
        """Mark the node unschedulable; returns False if it already was (someone else's cordon,
        which we then never undo)."""
        current = self.read_node(node)
        annotations = (current.metadata.annotations or {}) if current.metadata else {}
        if current.spec and current.spec.unschedulable and ANNOTATION_CORDONED_BY not in annotations:
            return False
        body = {"metadata": {"annotations": {ANNOTATION_CORDONED_BY: finding_id}}, "spec": {"unschedulable": True}}
        self._call(f"cordon node {node}", self.core.patch_node, node, body, _content_type=STRATEGIC, field_manager=self.config.field_manager)
        return True

    def uncordon(self, node: str, finding_id: str) -> bool:
        current = self.read_node(node)
        annotations = (current.metadata.annotations or {}) if current.metadata else {}
        if annotations.get(ANNOTATION_CORDONED_BY) != finding_id:
            return False
        body = {"metadata": {"annotations": {ANNOTATION_CORDONED_BY: None}}, "spec": {"unschedulable": None}}
        self._call(f"uncordon node {node}", self.core.patch_node, node, body, _content_type=STRATEGIC, field_manager=self.config.field_manager)
        return True

    def _set_taints(self, node: str, current: Any, taints: list[Any]) -> None:
        # Node taints have no merge key: the list is replaced whole, so send the full list with
        # the resourceVersion we read; a concurrent change makes the API answer 409, not lose it.
        body = {
            "metadata": {"resourceVersion": current.metadata.resource_version},
            "spec": {"taints": [self.core.api_client.sanitize_for_serialization(t) for t in taints]},
        }
        self._call(f"taint node {node}", self.core.patch_node, node, body, _content_type=MERGE, field_manager=self.config.field_manager)

    def taint(self, node: str, kind: str, finding_id: str, effect: str) -> None:
        current = self.read_node(node)
        key = f"{DOMAIN}/{kind}"
        taints = [t for t in (current.spec.taints or []) if t.key != key]
        taints.append(
            self.client.V1Taint(key=key, value=finding_id, effect=effect, time_added=datetime.now(UTC).replace(microsecond=0) if effect == "NoExecute" else None)
        )
        self._set_taints(node, current, taints)

    def untaint(self, node: str, kind: str, finding_id: str) -> bool:
        current = self.read_node(node)
        key = f"{DOMAIN}/{kind}"
        old = current.spec.taints or []
        taints = [t for t in old if not (t.key == key and t.value == finding_id)]
        if len(taints) == len(old):
            return False
        self._set_taints(node, current, taints)
        return True

    def set_condition(self, node: str, healthy: bool, reason: str, message: str) -> None:
        now = _now()
        condition = {
            "type": self.config.condition_type,
            "status": "True" if healthy else "False",
            "reason": reason,
            "message": message[:1024],
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }
        # Conditions merge by `type` under a strategic merge patch: the kubelet's stay intact.
        self._call(
            f"set condition {self.config.condition_type} on node {node}",
            self.core.patch_node_status,
            self._check_node(node),
            {"status": {"conditions": [condition]}},
            _content_type=STRATEGIC,
            field_manager=self.config.field_manager,
        )

    def annotate_node(self, node: str, key: str, value: str | None) -> None:
        self._call(
            f"annotate node {node}",
            self.core.patch_node,
            self._check_node(node),
            {"metadata": {"annotations": {key: value}}},
            _content_type=STRATEGIC,
            field_manager=self.config.field_manager,
        )

    # -- job primitives ---------------------------------------------------------------------
    def job_pods(self, job: str, node: str | None = None) -> list[Any]:
        ns, name = self.split_job(job)
        kwargs: dict[str, Any] = {"label_selector": f"{self.config.job_label}={name}"}
        if node:
            kwargs["field_selector"] = f"spec.nodeName={self._check_node(node)}"
        pods = self._call(f"list pods of job {ns}/{name}", self.core.list_namespaced_pod, ns, **kwargs)
        return [p for p in pods.items if not (p.status and p.status.phase in ("Succeeded", "Failed"))]

    def evict(self, pod: Any) -> None:
        name, ns = pod.metadata.name, pod.metadata.namespace
        body = self.client.V1Eviction(api_version="policy/v1", kind="Eviction", metadata=self.client.V1ObjectMeta(name=name, namespace=ns))
        try:
            self._call(f"evict pod {ns}/{name}", self.core.create_namespaced_pod_eviction, name, ns, body, field_manager=self.config.field_manager)
        except KubernetesError as exc:
            if "HTTP 429" in str(exc):
                raise KubernetesError(f"evict pod {ns}/{name}: blocked by a PodDisruptionBudget (HTTP 429); will retry") from exc
            if "HTTP 404" in str(exc):
                return  # already gone: what we wanted
            raise

    def evict_job_pods(self, job: str, nodes: Iterable[str]) -> list[str]:
        evicted = []
        for node in sorted(set(nodes)):
            for pod in self.job_pods(job, node):
                self.evict(pod)
                evicted.append(f"{pod.metadata.namespace}/{pod.metadata.name}")
        return evicted

    def annotate_job(self, job: str, verdict: dict[str, Any]) -> str:
        ns, name = self.split_job(job)
        body = {"metadata": {"annotations": {ANNOTATION_VERDICT: json.dumps(verdict, sort_keys=True)}}}
        try:
            self._call(f"annotate job {ns}/{name}", self.batch.patch_namespaced_job, name, ns, body, _content_type=STRATEGIC, field_manager=self.config.field_manager)
            return f"job {ns}/{name}"
        except KubernetesError as exc:
            if "HTTP 404" not in str(exc):
                raise
        # Not a batch/v1 Job (a JobSet, an operator's CR, bare pods): annotate its pods instead.
        pods = self.job_pods(job)
        if not pods:
            raise KubernetesError(f"annotate job {ns}/{name}: no batch/v1 Job and no pods labelled {self.config.job_label}={name}")
        for pod in pods:
            self._call(
                f"annotate pod {ns}/{pod.metadata.name}",
                self.core.patch_namespaced_pod,
                pod.metadata.name,
                ns,
                body,
                _content_type=STRATEGIC,
                field_manager=self.config.field_manager,
            )
        return f"{len(pods)} pod(s) of {ns}/{name}"

    @staticmethod
    def verdict(hint: Hint) -> dict[str, Any]:
        return {
            "action": hint.action.value,
            "finding": hint.finding_id,
            "kind": hint.finding_kind.value,
            "reason": hint.reason,
            "exclude_nodes": hint.exclude_nodes,
            "params": hint.params,
            "ts": hint.ts,
        }

    # -- hints ------------------------------------------------------------------------------
    def plan(self, hint: Hint) -> Plan:
        """The API calls for this hint (computed without the API: `--act dry-run` needs no
        credentials); raises KubernetesUnsupported / KubernetesError for a hint it cannot apply."""
        act, kind = hint.action, hint.finding_kind.value
        plan = Plan(hint, [])
        if act in (HintAction.CORDON_NODE, HintAction.DRAIN_NODE):
            node = self._check_node(hint.node)
            effect = "NoSchedule" if act == HintAction.CORDON_NODE else self.config.taint_effect.get(kind, self.config.taint_effect.get("default", "NoSchedule"))

            def cordon() -> str:
                ours = self.cordon(node, hint.finding_id)
                if not ours:
                    plan.outcome = "not_ours"  # someone else's cordon: never undone by us
                return f"cordoned {node}" + ("" if ours else " (already cordoned)")

            def taint() -> str:
                self.taint(node, kind, hint.finding_id, effect)
                self.set_condition(node, False, _camel(kind), hint.reason)
                return f"tainted {DOMAIN}/{kind}={hint.finding_id}:{effect}"

            plan.steps += [
                Step(f"cordon node {node}", cordon),
                Step(f"taint {DOMAIN}/{kind}={hint.finding_id}:{effect}, condition {self.config.condition_type}=False", taint),
            ]
            if act == HintAction.DRAIN_NODE and hint.job:
                job = hint.job
                plan.steps.append(Step(f"evict the pods of {job} on {node}", lambda: f"evicted {len(self.evict_job_pods(job, [node]))} pod(s)"))
            return plan
        if act == HintAction.REQUEUE_JOB:
            self.split_job(hint.job)
            nodes = hint.exclude_nodes or ([hint.node] if hint.node else [])

            def requeue() -> str:
                evicted = self.evict_job_pods(hint.job or "", nodes) if nodes else []
                target = self.annotate_job(hint.job or "", self.verdict(hint))
                return f"evicted {len(evicted)} pod(s) of {hint.job} from {','.join(nodes) or 'no node'}; verdict on {target}"

            plan.steps.append(Step(f"evict the pods of {hint.job} on {','.join(nodes) or 'no node'}; annotate {ANNOTATION_VERDICT} on {hint.job}", requeue))
            return plan
        if act in (HintAction.SET_ALLOC_CONF, HintAction.RESIZE_OR_MOVE_JOB, HintAction.COMPACT):
            if not hint.job:
                raise KubernetesUnsupported(f"{act.value} without a job: nothing to annotate")
            self.split_job(hint.job)
            plan.steps.append(Step(f"annotate {ANNOTATION_VERDICT} on {hint.job} ({act.value})", lambda: f"verdict on {self.annotate_job(hint.job or '', self.verdict(hint))}"))
            return plan
        if act == HintAction.AVOID_GPU:
            node = self._check_node(hint.node)

            def avoid() -> str:
                current = self.read_node(node)
                have = ((current.metadata.annotations or {}).get(ANNOTATION_AVOID_GPUS) or "").split(",")
                gpus = sorted({int(g) for g in have if g.strip().isdigit()} | {int(hint.gpu or 0)})
                self.annotate_node(node, ANNOTATION_AVOID_GPUS, ",".join(map(str, gpus)))
                return f"node {node} {ANNOTATION_AVOID_GPUS}={','.join(map(str, gpus))}"

            plan.steps.append(Step(f"annotate node {node} {ANNOTATION_AVOID_GPUS} += {hint.gpu}", avoid))
            return plan
        raise KubernetesUnsupported(f"unsupported hint action {act.value}")

    def apply(self, hint: Hint) -> str:
        return self.plan(hint).execute()

    def applied_by_us(self, hint: Hint) -> str | None:
        """What the API shows of this hint already applied by gpuvigil (the node cordoned for its
        finding), or None."""
        if hint.action not in (HintAction.CORDON_NODE, HintAction.DRAIN_NODE) or not hint.node:
            return None
        current = self.read_node(self._check_node(hint.node))
        annotations = (current.metadata.annotations or {}) if current.metadata else {}
        if current.spec and current.spec.unschedulable and annotations.get(ANNOTATION_CORDONED_BY) == hint.finding_id:
            return f"{hint.node} already cordoned by gpuvigil for {hint.finding_id}"
        return None

    def undo_plan(self, hint: Hint) -> Plan | None:
        """How to take back what `apply` did to the node, as far as it is still ours."""
        plan = Plan(hint, [])
        if hint.action in (HintAction.CORDON_NODE, HintAction.DRAIN_NODE) and hint.node:
            node = self._check_node(hint.node)

            def back() -> str:
                removed = self.untaint(node, hint.finding_kind.value, hint.finding_id)
                uncordoned = self.uncordon(node, hint.finding_id)
                if not removed and not uncordoned:
                    plan.outcome = "not_ours"
                self.set_condition(node, True, "CauseCleared", f"{hint.finding_kind.value} finding {hint.finding_id} cleared")
                return f"node {node}: " + ", ".join(x for x in ("taint removed" if removed else "", "uncordoned" if uncordoned else "", "condition True") if x)

            plan.steps.append(Step(f"remove taint {DOMAIN}/{hint.finding_kind.value}={hint.finding_id} from {node}, uncordon it if gpuvigil cordoned it, condition {self.config.condition_type}=True", back))
            return plan
        if hint.action == HintAction.AVOID_GPU and hint.node:
            node = self._check_node(hint.node)

            def unavoid() -> str:
                current = self.read_node(node)
                have = ((current.metadata.annotations or {}).get(ANNOTATION_AVOID_GPUS) or "").split(",")
                gpus = sorted({int(g) for g in have if g.strip().isdigit()} - {int(hint.gpu or 0)})
                self.annotate_node(node, ANNOTATION_AVOID_GPUS, ",".join(map(str, gpus)) or None)
                return f"node {node}: GPU {hint.gpu} no longer avoided"

            plan.steps.append(Step(f"annotate node {node} {ANNOTATION_AVOID_GPUS} -= {hint.gpu}", unavoid))
            return plan
        return None

    def undo(self, hint: Hint) -> str | None:
        """The hint's cause cleared: take back what `apply` did to the node, if it is still ours."""
        plan = self.undo_plan(hint)
        return (plan.execute() or None) if plan is not None else None

    def inventory(self) -> dict[str, int]:
        """Node → allocatable GPUs (`nvidia.com/gpu`), for the circuit breaker's share."""
        nodes = self._call("list nodes", self.core.list_node)
        out = {}
        for n in nodes.items:
            alloc = (n.status.allocatable or {}) if n.status else {}
            try:
                out[n.metadata.name] = int(alloc.get("nvidia.com/gpu", 0))
            except (TypeError, ValueError):
                out[n.metadata.name] = 0
        return out

    def record_quarantine(self, node: str, summary: dict[str, Any], message: str) -> None:
        """The audit trail where operators look: the node's `gpuvigil.io/quarantine` annotation
        (state, since, causes, finding ids) and an Event on the node."""
        node = self._check_node(node)
        self.annotate_node(node, ANNOTATION_QUARANTINE, json.dumps(summary, sort_keys=True))
        ts = _now()
        body = self.client.CoreV1Event(
            metadata=self.client.V1ObjectMeta(generate_name=f"{node}.gpuvigil.", namespace="default"),
            involved_object=self.client.V1ObjectReference(kind="Node", name=node, api_version="v1"),
            reason=f"Quarantine{_camel(str(summary.get('state', '')))}",
            message=message[:1024],
            type="Warning" if summary.get("state") not in ("healthy",) else "Normal",
            source=self.client.V1EventSource(component=self.config.field_manager),
            first_timestamp=ts,
            last_timestamp=ts,
            count=1,
        )
        # The answer is not read back (the event is write-only for us).
        self._call(f"record event on node {node}", self.core.create_namespaced_event, "default", body, _preload_content=False)

    def outcome(self, hint: Hint) -> str:
        return self.apply(hint)

"""The Kubernetes adapter's exact API requests.

No Kubernetes API server can run on these machines, so this is the one place the project uses a
fake: the official client runs for real (its API classes, models, serialisation and REST layer),
and only its urllib3 pool manager is replaced by `FakeApiServer`, which records each request's
method, path, query, Content-Type and JSON body and answers with canned responses built from the
client's own model classes (V1Node, V1PodList, V1Job, V1Eviction, V1Status). The tests assert the
requests, and that deploy/rbac.yaml grants exactly the verbs/resources they use.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import pytest
import urllib3
import yaml
from kubernetes import client

from gpuvigil.app.acting import Acting
from gpuvigil.api.store import HintState, HintStore
from gpuvigil.model import Finding, FindingKind, Hint, HintAction, Severity
from gpuvigil.scheduler.kubernetes import KubernetesAdapter, KubernetesError
from h_api_helpers import pipeline_into

REPO = Path(__file__).resolve().parents[1]
NODE = "gpu-node-7"
FID = "0123456789abcdef"


@dataclass
class Req:
    method: str
    path: str
    query: dict[str, str]
    content_type: str | None
    body: object


class FakeApiServer:
    """Stands in for urllib3's PoolManager under the real kubernetes ApiClient."""

    def __init__(self):
        self.requests: list[Req] = []
        self.routes: dict[tuple[str, str], tuple[int, object]] = {}
        self.serialize = client.ApiClient().sanitize_for_serialization

    def on(self, method: str, path: str, status: int, model: object) -> None:
        self.routes[(method, path)] = (status, self.serialize(model))

    def request(self, method, url, fields=None, body=None, headers=None, timeout=None, preload_content=True, **_):
        parts = urlsplit(url)
        self.requests.append(
            Req(method, parts.path, dict(parse_qsl(parts.query)), (headers or {}).get("Content-Type"), json.loads(body) if body else None)
        )
        status, payload = self.routes.get((method, parts.path), (200, {}))
        return urllib3.HTTPResponse(
            body=io.BytesIO(json.dumps(payload).encode()),
            status=status,
            reason={200: "OK", 201: "Created", 404: "Not Found", 429: "Too Many Requests", 409: "Conflict"}.get(status, ""),
            headers={"content-type": "application/json"},
            preload_content=False,
        )

    def calls(self) -> list[tuple[str, str]]:
        return [(r.method, r.path) for r in self.requests]


def node_model(*, annotations=None, unschedulable=None, taints=None):
    return client.V1Node(
        api_version="v1",
        kind="Node",
        metadata=client.V1ObjectMeta(name=NODE, resource_version="4711", annotations=annotations or {}, labels={"nvidia.com/gpu.product": "NVIDIA-H200"}),
        spec=client.V1NodeSpec(
            unschedulable=unschedulable,
            taints=taints if taints is not None else [client.V1Taint(key="nvidia.com/gpu", value="present", effect="NoSchedule")],
        ),
    )


def pod_model(name: str, ns: str = "ml", node: str = NODE, phase: str = "Running"):
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, namespace=ns, labels={"job-name": "llama-70b"}),
        spec=client.V1PodSpec(node_name=node, containers=[client.V1Container(name="trainer", image="trainer:1")]),
        status=client.V1PodStatus(phase=phase),
    )


def status_model(code: int, reason: str, message: str):
    return client.V1Status(api_version="v1", kind="Status", status="Failure", code=code, reason=reason, message=message)


@pytest.fixture
def api():
    fake = FakeApiServer()
    api_client = client.ApiClient(client.Configuration(host="https://k8s.invalid:6443"))
    api_client.rest_client.pool_manager = fake
    fake.on("GET", f"/api/v1/nodes/{NODE}", 200, node_model())
    fake.on("GET", "/api/v1/namespaces/ml/pods", 200, client.V1PodList(items=[pod_model("llama-70b-0-abcde"), pod_model("llama-70b-1-fghij")]))
    fake.on("POST", "/api/v1/namespaces/ml/pods/llama-70b-0-abcde/eviction", 201, client.V1Eviction(metadata=client.V1ObjectMeta(name="llama-70b-0-abcde")))
    fake.on("POST", "/api/v1/namespaces/ml/pods/llama-70b-1-fghij/eviction", 201, client.V1Eviction(metadata=client.V1ObjectMeta(name="llama-70b-1-fghij")))
    fake.on("PATCH", "/apis/batch/v1/namespaces/ml/jobs/llama-70b", 200, client.V1Job(metadata=client.V1ObjectMeta(name="llama-70b", namespace="ml")))
    return fake, KubernetesAdapter(api_client)


def hint(action: HintAction, kind: FindingKind = FindingKind.XID, **kw) -> Hint:
    base = {"ts": 1.0, "reason": f"{kind.value}: something broke", "finding_id": FID, "finding_kind": kind}
    return Hint(action=action, **{**base, **kw})


def test_cordon_sends_unschedulable_taint_and_condition(api):
    fake, adapter = api
    done = adapter.apply(hint(HintAction.CORDON_NODE, node=NODE))
    assert done == f"cordoned {NODE}, tainted gpuvigil.io/xid={FID}:NoSchedule"
    assert fake.calls() == [
        ("GET", f"/api/v1/nodes/{NODE}"),
        ("PATCH", f"/api/v1/nodes/{NODE}"),
        ("GET", f"/api/v1/nodes/{NODE}"),
        ("PATCH", f"/api/v1/nodes/{NODE}"),
        ("PATCH", f"/api/v1/nodes/{NODE}/status"),
    ]
    cordon, taint, condition = fake.requests[1], fake.requests[3], fake.requests[4]
    assert cordon.content_type == "application/strategic-merge-patch+json"
    assert cordon.body == {"metadata": {"annotations": {"gpuvigil.io/cordoned-by": FID}}, "spec": {"unschedulable": True}}
    assert cordon.query == {"fieldManager": "gpuvigil"}
    assert taint.content_type == "application/merge-patch+json"
    assert taint.body == {
        "metadata": {"resourceVersion": "4711"},
        "spec": {"taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}, {"key": "gpuvigil.io/xid", "value": FID, "effect": "NoSchedule"}]},
    }
    assert condition.content_type == "application/strategic-merge-patch+json"
    [cond] = condition.body["status"]["conditions"]
    assert {k: cond[k] for k in ("type", "status", "reason", "message")} == {
        "type": "GpuvigilHealthy",
        "status": "False",
        "reason": "Xid",
        "message": "xid: something broke",
    }
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", cond["lastTransitionTime"])


def test_drain_for_ecc_taints_noexecute_and_evicts_the_jobs_pods(api):
    fake, adapter = api
    done = adapter.apply(hint(HintAction.DRAIN_NODE, FindingKind.ECC, node=NODE, job="ml/llama-70b"))
    assert done == f"cordoned {NODE}, tainted gpuvigil.io/ecc={FID}:NoExecute, evicted 2 pod(s)"
    taint = fake.requests[3].body["spec"]["taints"][-1]
    assert (taint["key"], taint["effect"]) == ("gpuvigil.io/ecc", "NoExecute")
    assert abs(datetime.fromisoformat(taint["timeAdded"]).timestamp() - datetime.now(UTC).timestamp()) < 3600
    assert fake.requests[4].body["status"]["conditions"][0]["reason"] == "Ecc"
    lst = fake.requests[5]
    assert (lst.method, lst.path) == ("GET", "/api/v1/namespaces/ml/pods")
    assert lst.query == {"labelSelector": "job-name=llama-70b", "fieldSelector": f"spec.nodeName={NODE}"}
    evictions = fake.requests[6:]
    assert [(r.method, r.path) for r in evictions] == [
        ("POST", "/api/v1/namespaces/ml/pods/llama-70b-0-abcde/eviction"),
        ("POST", "/api/v1/namespaces/ml/pods/llama-70b-1-fghij/eviction"),
    ]
    assert evictions[0].body == {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "llama-70b-0-abcde", "namespace": "ml"}}


def test_requeue_evicts_from_the_bad_nodes_and_annotates_the_job(api):
    fake, adapter = api
    h = hint(HintAction.REQUEUE_JOB, FindingKind.COLLECTIVE_HANG, job="ml/llama-70b", node=NODE, exclude_nodes=[NODE])
    done = adapter.apply(h)
    assert done == f"evicted 2 pod(s) of ml/llama-70b from {NODE}; verdict on job ml/llama-70b"
    patch = fake.requests[-1]
    assert (patch.method, patch.path, patch.content_type) == ("PATCH", "/apis/batch/v1/namespaces/ml/jobs/llama-70b", "application/strategic-merge-patch+json")
    verdict = json.loads(patch.body["metadata"]["annotations"]["gpuvigil.io/verdict"])
    assert verdict == {
        "action": "requeue_job",
        "finding": FID,
        "kind": "collective_hang",
        "reason": "collective_hang: something broke",
        "exclude_nodes": [NODE],
        "params": {},
        "ts": 1.0,
    }


def test_annotation_falls_back_to_pods_when_there_is_no_batch_job(api):
    fake, adapter = api
    fake.on("PATCH", "/apis/batch/v1/namespaces/ml/jobs/llama-70b", 404, status_model(404, "NotFound", 'jobs.batch "llama-70b" not found'))
    done = adapter.apply(hint(HintAction.SET_ALLOC_CONF, FindingKind.OOM_FRAGMENTATION, job="ml/llama-70b", params={"alloc_conf": "expandable_segments:True"}))
    assert done == "verdict on 2 pod(s) of ml/llama-70b"
    assert fake.calls()[-3:] == [
        ("GET", "/api/v1/namespaces/ml/pods"),
        ("PATCH", "/api/v1/namespaces/ml/pods/llama-70b-0-abcde"),
        ("PATCH", "/api/v1/namespaces/ml/pods/llama-70b-1-fghij"),
    ]
    assert fake.requests[-3].query == {"labelSelector": "job-name=llama-70b"}
    verdict = json.loads(fake.requests[-1].body["metadata"]["annotations"]["gpuvigil.io/verdict"])
    assert verdict["params"] == {"alloc_conf": "expandable_segments:True"}


def test_an_operators_cordon_is_left_alone(api):
    fake, adapter = api
    fake.on("GET", f"/api/v1/nodes/{NODE}", 200, node_model(unschedulable=True))
    done = adapter.apply(hint(HintAction.CORDON_NODE, node=NODE))
    assert done.startswith(f"cordoned {NODE} (already cordoned)")
    # No cordon patch (and so no cordoned-by claim): only the taint and the condition.
    assert fake.calls() == [
        ("GET", f"/api/v1/nodes/{NODE}"),
        ("GET", f"/api/v1/nodes/{NODE}"),
        ("PATCH", f"/api/v1/nodes/{NODE}"),
        ("PATCH", f"/api/v1/nodes/{NODE}/status"),
    ]
    before_undo = len(fake.requests)
    assert adapter.undo(hint(HintAction.CORDON_NODE, node=NODE)) == f"node {NODE}: condition True"
    # The node is still the operator's: no taint of ours to remove, no uncordon.
    assert [(r.method, r.path) for r in fake.requests[before_undo:] if r.method == "PATCH"] == [("PATCH", f"/api/v1/nodes/{NODE}/status")]


def test_undo_when_the_cause_clears_removes_our_taint_and_cordon(api):
    fake, adapter = api
    ours = client.V1Taint(key="gpuvigil.io/xid", value=FID, effect="NoSchedule")
    other = client.V1Taint(key="nvidia.com/gpu", value="present", effect="NoSchedule")
    fake.on("GET", f"/api/v1/nodes/{NODE}", 200, node_model(annotations={"gpuvigil.io/cordoned-by": FID}, unschedulable=True, taints=[other, ours]))
    done = adapter.undo(hint(HintAction.CORDON_NODE, node=NODE))
    assert done == f"node {NODE}: taint removed, uncordoned, condition True"
    patches = [r for r in fake.requests if r.method == "PATCH"]
    assert patches[0].body == {"metadata": {"resourceVersion": "4711"}, "spec": {"taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]}}
    assert patches[1].body == {"metadata": {"annotations": {"gpuvigil.io/cordoned-by": None}}, "spec": {"unschedulable": None}}
    cond = patches[2].body["status"]["conditions"][0]
    assert (cond["status"], cond["reason"]) == ("True", "CauseCleared")


def test_avoid_gpu_merges_into_the_node_annotation(api):
    fake, adapter = api
    fake.on("GET", f"/api/v1/nodes/{NODE}", 200, node_model(annotations={"gpuvigil.io/avoid-gpus": "5"}))
    done = adapter.apply(hint(HintAction.AVOID_GPU, FindingKind.THERMAL_THROTTLE, node=NODE, gpu=2))
    assert done == f"node {NODE} gpuvigil.io/avoid-gpus=2,5"
    assert fake.requests[-1].body == {"metadata": {"annotations": {"gpuvigil.io/avoid-gpus": "2,5"}}}


def test_blocked_eviction_keeps_the_hint_pending_with_the_reason(api, tmp_path):
    fake, adapter = api
    fake.on("POST", "/api/v1/namespaces/ml/pods/llama-70b-0-abcde/eviction", 429, status_model(429, "TooManyRequests", "Cannot evict pod as it would violate the pod's disruption budget."))
    finding = Finding(kind=FindingKind.OOM_FOREIGN_PROCESS, severity=Severity.PAGE, ts=0, job="ml/llama-70b", node=NODE, gpu=0, summary="a foreign process holds 30 GiB")
    with HintStore(tmp_path / "h.db") as store:
        adapter.store = store
        pipe = pipeline_into(store, [[finding]] * 3)
        pipe.sinks.append(Acting("kubernetes", "on", store=store, adapter=adapter))  # production's apply loop
        pipe.tick(10.0)
        [rec] = store.hints()
        assert (rec.action, rec.state, rec.attempts) == (HintAction.REQUEUE_JOB, HintState.PENDING, 1)
        assert rec.last_error == "evict pod ml/llama-70b-0-abcde: blocked by a PodDisruptionBudget (HTTP 429); will retry"
        # The budget frees up; once the retry backoff has passed, the next tick applies it.
        fake.on("POST", "/api/v1/namespaces/ml/pods/llama-70b-0-abcde/eviction", 201, client.V1Eviction())
        pipe.tick(11.0)
        assert store.get_hint(rec.id).attempts == 1  # not due yet: 5 s backoff after a failure
        adapter.config = adapter.config.model_copy(update={"retry_base_seconds": 0.0})
        pipe.tick(12.0)
        assert store.get_hint(rec.id).state == HintState.ACKED


@pytest.mark.parametrize(
    "h,error",
    [
        (hint(HintAction.CORDON_NODE, node="Bad_Node"), "not a Kubernetes node name"),
        (hint(HintAction.REQUEUE_JOB, job="ml/Llama 70b", node=NODE), "not a Kubernetes namespace/name"),
        (hint(HintAction.RESIZE_OR_MOVE_JOB), "without a job"),
    ],
)
def test_bad_hints_raise_clear_errors(api, h, error):
    _, adapter = api
    with pytest.raises(KubernetesError, match=error):
        adapter.apply(h)


def test_api_errors_name_the_call_and_the_answer(api):
    fake, adapter = api
    fake.on("GET", f"/api/v1/nodes/{NODE}", 403, status_model(403, "Forbidden", f'nodes "{NODE}" is forbidden: User "system:serviceaccount:gpuvigil:gpuvigil" cannot get resource "nodes"'))
    with pytest.raises(KubernetesError, match=rf'^read node {NODE}: HTTP 403 nodes "{NODE}" is forbidden'):
        adapter.apply(hint(HintAction.CORDON_NODE, node=NODE))


# -- RBAC: deploy/rbac.yaml grants exactly what the adapter calls ------------------------------
def _rbac_need(r: Req) -> tuple[str, str, str]:
    verb = {"GET": "get", "PATCH": "patch", "POST": "create", "DELETE": "delete"}[r.method]
    if r.path == "/api/v1/nodes":
        return ("", "nodes", "list")
    if re.fullmatch(r"/api/v1/namespaces/[^/]+/events", r.path):
        return ("", "events", verb)
    m = re.fullmatch(r"/api/v1/nodes/[^/]+(/status)?", r.path)
    if m:
        return ("", "nodes" + (m.group(1) or ""), verb)
    m = re.fullmatch(r"/api/v1/namespaces/[^/]+/pods(/[^/]+)?(/eviction)?", r.path)
    if m:
        if m.group(2):
            return ("", "pods/eviction", verb)
        return ("", "pods", "list" if (verb == "get" and not m.group(1)) else verb)
    m = re.fullmatch(r"/apis/batch/v1/namespaces/[^/]+/jobs/[^/]+", r.path)
    if m:
        return ("batch", "jobs", verb)
    raise AssertionError(f"unmapped request {r.method} {r.path}")


def test_rbac_manifest_grants_exactly_the_calls_the_adapter_makes(api):
    fake, adapter = api
    adapter.apply(hint(HintAction.DRAIN_NODE, FindingKind.ECC, node=NODE, job="ml/llama-70b"))
    adapter.apply(hint(HintAction.REQUEUE_JOB, job="ml/llama-70b", exclude_nodes=[NODE]))
    adapter.apply(hint(HintAction.AVOID_GPU, node=NODE, gpu=1))
    adapter.undo(hint(HintAction.DRAIN_NODE, FindingKind.ECC, node=NODE))
    fake.on("PATCH", "/apis/batch/v1/namespaces/ml/jobs/llama-70b", 404, status_model(404, "NotFound", "not found"))
    adapter.apply(hint(HintAction.COMPACT, job="ml/llama-70b"))
    fake.on("GET", "/api/v1/nodes", 200, client.V1NodeList(items=[node_model()]))
    adapter.inventory()
    adapter.record_quarantine(NODE, {"state": "draining"}, "suspect -> draining")
    needed = {_rbac_need(r) for r in fake.requests}

    docs = list(yaml.safe_load_all((REPO / "deploy" / "rbac.yaml").read_text()))
    [role] = [d for d in docs if d["kind"] == "ClusterRole"]
    granted = {(g, res, v) for rule in role["rules"] for g in rule["apiGroups"] for res in rule["resources"] for v in rule["verbs"]}
    assert needed == granted
    binding = next(d for d in docs if d["kind"] == "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    # The doc lists the same rules.
    doc = (REPO / "docs" / "kubernetes-rbac.md").read_text()
    for group, resource, verb in granted:
        assert f"| `{group or 'core'}` | `{resource}` |" in doc and verb in doc


def test_dry_run_plan_needs_no_client_and_is_what_apply_runs(api):
    """`--act dry-run` prints the adapter's own plan; `apply` runs the same steps."""
    fake, adapter = api
    offline = KubernetesAdapter(connect=False)
    h = hint(HintAction.DRAIN_NODE, FindingKind.ECC, node=NODE, job="ml/llama-70b")
    text = offline.plan(h).describe()
    assert text == f"cordon node {NODE}, taint gpuvigil.io/ecc={FID}:NoExecute, condition GpuvigilHealthy=False, evict the pods of ml/llama-70b on {NODE}"
    assert adapter.plan(h).describe() == text
    assert adapter.apply(h) == f"cordoned {NODE}, tainted gpuvigil.io/ecc={FID}:NoExecute, evicted 2 pod(s)"


def test_inventory_and_the_quarantine_audit_on_the_node(api):
    fake, adapter = api
    gpu_node = node_model()
    gpu_node.status = client.V1NodeStatus(allocatable={"nvidia.com/gpu": "8", "cpu": "96"})
    fake.on("GET", "/api/v1/nodes", 200, client.V1NodeList(items=[gpu_node]))
    assert adapter.inventory() == {NODE: 8}
    adapter.record_quarantine(NODE, {"state": "draining", "finding_ids": [FID]}, f"suspect -> draining by rule (applied) [{FID}]")
    annotate, event = fake.requests[-2:]
    assert (annotate.method, annotate.path) == ("PATCH", f"/api/v1/nodes/{NODE}")
    assert json.loads(annotate.body["metadata"]["annotations"]["gpuvigil.io/quarantine"]) == {"state": "draining", "finding_ids": [FID]}
    assert (event.method, event.path) == ("POST", "/api/v1/namespaces/default/events")
    assert event.body["involvedObject"] == {"kind": "Node", "name": NODE, "apiVersion": "v1"}
    assert (event.body["reason"], event.body["type"]) == ("QuarantineDraining", "Warning")
    assert FID in event.body["message"]


def test_acting_on_kubernetes_stops_at_the_breaker_and_leaves_an_operators_cordon(tmp_path):
    """Production's apply loop over the adapter, the API faked as above (FakeApiServer under the
    real client): a storm of fatal XIDs on 3 of 4 nodes cordons one (25% of the fleet), opens the
    breaker with one page and patches nothing more; a node an operator cordoned is recorded as
    operator_held and its cordon is never lifted."""
    from gpuvigil.scheduler.quarantine import QuarantineStore, State

    fake = FakeApiServer()
    api_client = client.ApiClient(client.Configuration(host="https://k8s.invalid:6443"))
    api_client.rest_client.pool_manager = fake
    names = [f"gpu-node-{i}" for i in range(1, 5)]
    listed = []
    for n in names:
        m = node_model(unschedulable=True if n == "gpu-node-4" else None)
        m.metadata.name = n
        m.status = client.V1NodeStatus(allocatable={"nvidia.com/gpu": "8"})
        fake.on("GET", f"/api/v1/nodes/{n}", 200, m)
        listed.append(m)
    fake.on("GET", "/api/v1/nodes", 200, client.V1NodeList(items=listed))
    pages = []

    def xid_on(node):
        return Finding(kind=FindingKind.XID, severity=Severity.PAGE, ts=0, node=node, gpu=0, xid=79, evidence={"fatal": True}, summary=f"XID 79 on {node}")

    with HintStore(tmp_path / "h.db") as store:
        adapter = KubernetesAdapter(api_client, store=store)
        acting = Acting("kubernetes", "on", store=store, adapter=adapter, quarantine=QuarantineStore(tmp_path / "q.db"), pager=lambda t, firing: pages.append(t))
        pipe = pipeline_into(store, [[xid_on(n) for n in names[:3]]] * 3)
        pipe.sinks.append(acting)
        pipe.tick(10.0)
        pipe.tick(11.0)
        cordons = [r.path for r in fake.requests if r.method == "PATCH" and (r.body or {}).get("spec", {}).get("unschedulable") is True]
        assert cordons == ["/api/v1/nodes/gpu-node-1"]
        # The page counts every node held back in the tick that tripped it.
        assert len(pages) == 1 and pages[0].startswith("breaker open: 2 node(s) would have been drained (16 GPU(s)), top causes xid (2)")
        assert acting.machine.get("gpu-node-2").state == acting.machine.get("gpu-node-3").state == State.SUSPECT
        # The audit trail on the node: its quarantine annotation and an Event.
        notes = [json.loads(r.body["metadata"]["annotations"]["gpuvigil.io/quarantine"]) for r in fake.requests
                 if r.method == "PATCH" and r.path == "/api/v1/nodes/gpu-node-1" and "gpuvigil.io/quarantine" in (r.body or {}).get("metadata", {}).get("annotations", {})]
        assert [n["state"] for n in notes] == ["suspect", "cordoned"]
        assert any(r.method == "POST" and r.path == "/api/v1/namespaces/default/events" for r in fake.requests)

    with HintStore(tmp_path / "h2.db") as store:
        acting = Acting("kubernetes", "on", store=store, adapter=KubernetesAdapter(api_client, store=store), quarantine=QuarantineStore(tmp_path / "q2.db"))
        pipe = pipeline_into(store, [[xid_on("gpu-node-4")]])
        pipe.sinks.append(acting)
        before = len(fake.requests)
        for t in (10.0, 700.0, 701.0, 1400.0, 1401.0, 1402.0):  # cleared at 700 (XID), far past the hold-down
            pipe.tick(t)
        assert acting.machine.get("gpu-node-4").state == State.OPERATOR_HELD
        lifted = [r for r in fake.requests[before:] if r.method == "PATCH" and (r.body or {}).get("spec", {}).get("unschedulable", True) is None]
        assert lifted == []

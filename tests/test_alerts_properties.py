"""Property test: whatever a finding holds (untrusted job/node names, odd evidence), the alert
the pusher builds is one Alertmanager accepts: valid label names, non-empty string values,
JSON-serialisable annotations, startsAt <= endsAt."""

from __future__ import annotations

import json
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuvigil.alerts.pusher import AlertPusher
from gpuvigil.alerts.settings import load_settings
from gpuvigil.model import Finding, FindingKind, Severity

LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)
evidence_value = st.one_of(st.none(), st.booleans(), st.integers(-2**62, 2**62), st.floats(allow_nan=False, allow_infinity=False), text,
                           st.lists(st.integers(0, 1000), max_size=5))


@settings(max_examples=100, deadline=None)
@given(kind=st.sampled_from(list(FindingKind)), severity=st.sampled_from(list(Severity)), job=st.one_of(st.none(), text),
       node=st.one_of(st.none(), text), gpu=st.one_of(st.none(), st.integers(0, 7)), tenant=text,
       evidence=st.dictionaries(st.text(min_size=1, max_size=10), evidence_value, max_size=5), summary=text,
       start=st.floats(1e9, 2e9), length=st.floats(0, 1e5))
def test_alert_payload_is_always_valid(tmp_path_factory, kind, severity, job, node, gpu, tenant, evidence, summary, start, length):
    pusher = _pusher(tmp_path_factory)
    finding = Finding(kind=kind, severity=severity, ts=0, job=job, node=node, gpu=gpu, evidence=evidence, summary=summary)
    alert = pusher.alert_for(finding, {job or "": tenant}, starts_at=start, ends_at=start + length)
    assert all(LABEL_NAME.match(k) for k in alert["labels"])
    assert all(isinstance(v, str) and v for v in alert["labels"].values())
    assert {"alertname", "severity", "kind", "team", "scope", "origin"} <= set(alert["labels"])
    assert alert["startsAt"] <= alert["endsAt"]
    assert json.loads(alert["annotations"]["evidence"]) == json.loads(json.dumps(evidence, sort_keys=True))
    json.dumps(alert)
    if alert["labels"].get("hardware") == "fatal":
        assert kind.value in ("xid", "ecc", "row_remap_failure") and severity == Severity.PAGE


_PUSHERS: dict[str, AlertPusher] = {}


def _pusher(factory) -> AlertPusher:
    if "p" not in _PUSHERS:
        _PUSHERS["p"] = AlertPusher("http://127.0.0.1:9", factory.mktemp("outbox") / "o.sqlite", load_settings())
    return _PUSHERS["p"]

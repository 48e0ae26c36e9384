"""`gpuvigil dashboards build [--check]`: write the Grafana dashboards (JSON) into `dashboards/`.

`--check` writes nothing and exits 1 when a checked-in dashboard differs from the generator."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from gpuvigil.errors import OneLineErrorParser
from gpuvigil.util.generated import write_or_check


class _Encoder(json.JSONEncoder):
    # grafanalib objects serialise through their public `to_json_data()` (what grafanalib's own,
    # private, `_gen.DashboardEncoder` does).
    def default(self, obj: Any) -> Any:
        to_json = getattr(obj, "to_json_data", None)
        return to_json() if callable(to_json) else super().default(obj)


def _dashboards() -> dict[str, Any]:
    from gpuvigil.util.extras import require

    # grafanalib is the [build] extra: only regenerating the committed JSON needs it.
    require("grafanalib.core", "gpuvigil dashboards build")
    from gpuvigil.dashboards.definitions import DASHBOARDS

    return DASHBOARDS


def dashboard_json(name: str) -> dict[str, Any]:
    return json.loads(json.dumps(_dashboards()[name]().to_json_data(), cls=_Encoder))


def artefacts() -> dict[str, str]:
    return {f"{name}.json": json.dumps(dashboard_json(name), indent=2, sort_keys=True) + "\n" for name in _dashboards()}


def panel_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel, rows included."""
    out = []
    for panel in dashboard.get("panels", []):
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []) or []:
                if target.get("expr"):
                    out.append((inner.get("title", ""), target["expr"]))
    return out


def _run(args: argparse.Namespace) -> int:
    return write_or_check(artefacts(), Path(args.out), check=args.check, what="dashboards")


def add_parser(sub) -> None:
    p = sub.add_parser("dashboards", help="generate the Grafana dashboards")
    dsub = p.add_subparsers(dest="dashboards_command", metavar="ACTION", parser_class=OneLineErrorParser)
    dsub.required = True
    b = dsub.add_parser("build", help="write dashboards/*.json")
    b.add_argument("--out", default="dashboards", help="output folder (default: dashboards)")
    b.add_argument("--check", action="store_true", help="write nothing; exit 1 if the files in --out are not current")
    b.set_defaults(func=_run)

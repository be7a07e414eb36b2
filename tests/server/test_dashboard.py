"""The Grafana dashboard in deploy/grafana reads Ferrum's metric families and no others, and every
family the server exposes has a panel."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ferrum.server.metrics import METRIC_NAMES, SPEC_METRIC_NAMES

KNOWN = METRIC_NAMES | SPEC_METRIC_NAMES

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "ferrum.json"


def _exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]


def _families(expr: str) -> set[str]:
    names = set(re.findall(r"\bferrum_[a-z0-9_]+", expr))
    return {re.sub(r"_(bucket|sum|count)$", "", n) if re.sub(r"_(bucket|sum|count)$", "", n) in KNOWN else n
            for n in names}


def test_dashboard_reads_only_known_metrics_and_all_of_them() -> None:
    exprs = _exprs()
    assert exprs and all(e.count("(") == e.count(")") for e in exprs)
    read = set().union(*(_families(e) for e in exprs))
    assert read <= KNOWN, read - KNOWN
    assert KNOWN <= read, KNOWN - read


def test_dashboard_is_importable_json_with_a_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert dashboard["uid"] and dashboard["title"] and len({p["id"] for p in dashboard["panels"]}) == len(
        dashboard["panels"])
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]

"""Debian's Prometheus (``apt-get install prometheus``; scripts/system-packages.sh) run on loopback with a
temporary configuration, for the tests (tests/ops/test_prometheus.py) and benchmarks/dashboard_shot.py: it
scrapes a syncer (job ``yeto-syncer``) and islands (job ``yeto-island``), loads the alert rules
(docs/grafana/yeto-alerts.yml, with their ``for:`` shortened when asked) and answers PromQL through its HTTP API.

    with Prometheus(tmp, syncers=["127.0.0.1:9464"], islands=["127.0.0.1:9465"], rule_for="2s") as prom:
        prom.query('yeto_syncer_members')            # the API's result list (instant query)
        prom.firing()                                # {alertname: [labels, ...]} of the alerts firing now
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RULES = os.path.join(ROOT, "docs", "grafana", "yeto-alerts.yml")
DASHBOARD = os.path.join(ROOT, "docs", "grafana", "yeto-syncer.json")
BINARY = shutil.which("prometheus") or ("/usr/bin/prometheus" if os.path.exists("/usr/bin/prometheus") else None)


def dashboard_queries(rate_interval: str) -> List[tuple]:
    """(panel title, PromQL) of every target of the dashboard, ``$__rate_interval`` given as `rate_interval`."""
    with open(DASHBOARD) as f:
        dash = json.load(f)
    return [(p["title"], t["expr"].replace("$__rate_interval", rate_interval))
            for p in dash["panels"] for t in p.get("targets", [])]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """A Prometheus server on 127.0.0.1 scraping `syncers` and `islands` (host:port) every `scrape` seconds.
    `rule_for`: replaces every alert rule's ``for:`` (None: the rules as shipped)."""

    def __init__(self, workdir: str, syncers: Sequence[str], islands: Sequence[str] = (), scrape: str = "1s",
                 rule_for: Optional[str] = None, port: Optional[int] = None, binary: Optional[str] = None):
        self.binary = binary or BINARY
        if self.binary is None:
            raise FileNotFoundError("prometheus is not installed (Debian: apt-get install prometheus; "
                                    "scripts/system-packages.sh)")
        self.workdir, self.port = workdir, port or _free_port()
        os.makedirs(workdir, exist_ok=True)
        with open(RULES) as f:
            rules = f.read()
        if rule_for is not None:
            rules = re.sub(r"^(\s+for:) .*$", rf"\1 {rule_for}", rules, flags=re.M)
        with open(os.path.join(workdir, "yeto-alerts.yml"), "w") as f:
            f.write(rules)
        jobs = [("yeto-syncer", syncers)] + ([("yeto-island", islands)] if islands else [])
        config = {"global": {"scrape_interval": scrape, "evaluation_interval": scrape, "scrape_timeout": scrape},
                  "rule_files": ["yeto-alerts.yml"],
                  "scrape_configs": [{"job_name": j, "static_configs": [{"targets": list(t)}]} for j, t in jobs]}
        self.config = os.path.join(workdir, "prometheus.yml")
        with open(self.config, "w") as f:
            json.dump(config, f)   # (JSON is YAML)
        self.proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "Prometheus":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = 30.0) -> None:
        self.log = open(os.path.join(self.workdir, "prometheus.log"), "w")
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={self.config}", f"--storage.tsdb.path={self.workdir}/data",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=self.workdir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}: {self.text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready after {timeout:.0f}s: {self.text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if getattr(self, "log", None) is not None and not self.log.closed:
            self.log.close()

    def text(self) -> str:
        with open(os.path.join(self.workdir, "prometheus.log"), errors="replace") as f:
            return f.read()

    def api(self, path: str, **params) -> dict:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as r:
            out = json.load(r)
        if out.get("status") != "success":
            raise RuntimeError(f"prometheus {path}: {out}")
        return out["data"]

    def query(self, expr: str, at: Optional[float] = None) -> list:
        """An instant query's result (a list of {"metric": labels, "value": [t, "v"]})."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self.api("query", **params)
        return data["result"] if data["resultType"] == "vector" else [{"metric": {}, "value": data["result"]}]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list:
        return self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:g}")["result"]

    def targets(self) -> Dict[str, str]:
        """{scrape URL: health} of the active targets."""
        return {t["scrapeUrl"]: t["health"] for t in self.api("targets")["activeTargets"]}

    def firing(self) -> Dict[str, list]:
        """{alertname: [labels of each firing alert]}."""
        out: Dict[str, list] = {}
        for a in self.api("alerts")["alerts"]:
            if a.get("state") == "firing":
                out.setdefault(a["labels"]["alertname"], []).append(a["labels"])
        return out

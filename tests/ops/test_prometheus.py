"""Real Prometheus (Debian's, on loopback) over a real syncer and two real megatron-core islands (torchrun, CPU,
gloo; attached only through PYTHONPATH and YETO_* variables, each island's rank 0 serving its metrics on
YETO_DILOCO_METRICS_PORT): every query of the Grafana dashboard, evaluated by Prometheus' own engine through
its HTTP API, returns series; the islands' metrics are scraped; and when an island is killed, the alert rules
shipped in docs/grafana/yeto-alerts.yml (their `for:` shortened to 2 s) fire for it. The syncer refuses stale
pushes (--max-base-lag 0, one push per round merges) so that the refusal panels have series too."""
import time

import pytest

from benchmarks.prometheus_run import BINARY, Prometheus, dashboard_queries
from tests.shim import procs as P

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(BINARY is None, reason="prometheus not installed (Debian's prometheus: "
                                 "scripts/system-packages.sh installs it as root with apt-get)")]


def _wait(what, fn, timeout, procs, prom):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last is True:
            return
        if any(p.poll() not in (None,) for p in procs):
            break
        time.sleep(1.0)
    pytest.fail(f"{what}: {last}\n{P.logs(procs)}\n===== prometheus =====\n{prom.text()[-3000:]}")


def test_dashboard_queries_and_an_alert_through_real_prometheus(tmp_path):
    port, mport = P.free_port(), P.free_port()
    iports = {"a": P.free_port(), "b": P.free_port()}
    syncer = P.start_syncer(tmp_path, port, islands=2, fragments=2, quorum=1,
                            extra=["--metrics-port", str(mport), "--max-base-lag", "0", "--lease", "5"])
    env = dict(YETO_DILOCO_SYNC_EVERY=2, YETO_DILOCO_OVERLAP_STEPS=1, YETO_DILOCO_TIMEOUT=120,
               YETO_DILOCO_INSECURE=1, YETO_DILOCO_PUSH_DTYPE="int8")
    islands = {name: P.start_island(tmp_path, name, port, ["--data-seed", str(i), "--no-save", "--step-sleep", "0.05"],
                                    100000, {**env, "YETO_DILOCO_METRICS_PORT": iports[name]}, nproc=1)
               for i, name in enumerate(iports)}
    procs = [syncer, *islands.values()]
    prom = Prometheus(str(tmp_path / "prom"), syncers=[f"127.0.0.1:{mport}"],
                      islands=[f"127.0.0.1:{p}" for p in iports.values()], scrape="1s", rule_for="2s",
                      port=P.free_port())
    try:
        prom.start()
        queries = dashboard_queries("15s")

        def empty_panels():
            empty = [f"{title}: {expr}" for title, expr in queries if not prom.query(expr)]
            return True if not empty else empty
        _wait("dashboard queries with no series", empty_panels, 150, procs, prom)
        for title, expr in queries:   # (and the panels that group by island see both islands)
            if "by (island" in expr and "refused" not in expr:
                assert {s["metric"].get("island") for s in prom.query(expr)} >= {"a", "b"}, (title, expr)

        def islands_scraped():
            up = {s["metric"]["island"]: s["value"][1] for s in prom.query("yeto_island_syncer_reachable")}
            pushed = prom.query("yeto_island_pushes_total > 0")
            return True if up == {"a": "1", "b": "1"} and len(pushed) == 2 else (up, pushed)
        _wait("the islands' own metrics", islands_scraped, 30, procs, prom)
        assert not prom.firing().get("YetoIslandMetricsDown")

        islands["b"].kill()   # an island gone: Prometheus' scrape of it fails, the rule fires for it
        procs.remove(islands["b"])
        target = f"127.0.0.1:{iports['b']}"

        def fired():
            down = prom.firing().get("YetoIslandMetricsDown", [])
            return True if [a["instance"] for a in down] == [target] else prom.firing()
        _wait("YetoIslandMetricsDown for the killed island", fired, 30, procs, prom)
        assert prom.query('up{job="yeto-island",instance="%s"}' % target)[0]["value"][1] == "0"
    finally:
        prom.stop()
        for p in procs:
            p.kill()

"""An island's Prometheus metrics (island/exporter.py, YETO_DILOCO_METRICS_PORT): the boundary log's records
become counters and gauges, the link is read at each scrape (the syncer unreachable for how long), and the port
serves them over real HTTP on the bounded server, closed with the boundary log."""
import urllib.request

from yeto_patch.island.boundary.log import BoundaryLog
from yeto_patch.island.exporter import IslandExporter


def _value(text: str, sample: str) -> float:
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{sample} not in\n{text}")


def test_records_and_the_link_become_metrics_served_over_http(tmp_path):
    now = [100.0]
    up = [True]
    ex = IslandExporter("isl<1>", reachable=lambda: up[0], clock=lambda: now[0])
    blog = BoundaryLog(str(tmp_path / "b.jsonl"), "isl<1>")
    blog.add_sink(ex.record, close=ex.close)
    port = ex.serve(0)
    blog.write("boundary", step=8, fragment=1, version=3, wait_ms=1500.0, staged_wait_ms=500.0)
    blog.write("install", step=9, fragment=0, version=2, snapshot_wait_ms=250.0)
    blog.write("reconnect", step=10, seconds=1.5)
    blog.write("boundary", step=16, fragment=1, version=4, wait_ms=float("nan"))   # (a bad figure counts nothing)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    lab = '{island="isl<1>"}'
    assert _value(text, "yeto_island_syncer_reachable" + lab) == 1
    assert _value(text, "yeto_island_syncer_unreachable_seconds" + lab) == 0
    assert _value(text, "yeto_island_step" + lab) == 16
    assert _value(text, "yeto_island_pushes_total" + lab) == 2
    assert _value(text, "yeto_island_wait_seconds_total" + lab) == 2.25
    assert _value(text, "yeto_island_reconnects_total" + lab) == 1
    assert _value(text, 'yeto_island_fragment_version{fragment="1",island="isl<1>"}') == 4
    assert _value(text, 'yeto_island_fragment_version{fragment="0",island="isl<1>"}') == 2
    assert _value(text, "yeto_island_last_install_timestamp_seconds" + lab) > 1e9
    up[0] = False   # the syncer goes away: unreachable counts from the last scrape that found it
    now[0] = 130.0
    assert _value(ex.scrape().decode(), "yeto_island_syncer_unreachable_seconds" + lab) == 30
    now[0] = 190.0
    text = ex.scrape().decode()
    assert _value(text, "yeto_island_syncer_unreachable_seconds" + lab) == 90
    assert _value(text, "yeto_island_syncer_reachable" + lab) == 0
    up[0] = True
    assert _value(ex.scrape().decode(), "yeto_island_syncer_unreachable_seconds" + lab) == 0
    blog.close()   # closes the port too
    assert ex.server is None
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    except OSError:
        pass
    else:
        raise AssertionError("the island's metrics port is still open after the boundary log closed")


def test_a_link_that_raises_reads_as_unreachable():
    def broken():
        raise RuntimeError("torn down")
    ex = IslandExporter("a", reachable=broken)
    assert 'yeto_island_syncer_reachable{island="a"} 0.0' in ex.scrape().decode()

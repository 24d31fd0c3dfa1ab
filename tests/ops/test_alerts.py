"""The alert rules shipped beside the dashboard (docs/grafana/yeto-alerts.yml): Prometheus' own promtool checks
them and runs their unit tests (tests/ops/yeto-alerts.test.yml: each alert fires on what should page someone and
not on healthy series), a broken threshold makes those tests fail, and every metric a rule reads is one the
syncer or an island exports. promtool comes from Debian's prometheus (scripts/system-packages.sh)."""
import os
import re
import shutil
import subprocess

import pytest

from tests.ops.exported import exported

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RULES = os.path.join(ROOT, "docs", "grafana", "yeto-alerts.yml")
RULE_TESTS = os.path.join(ROOT, "tests", "ops", "yeto-alerts.test.yml")
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian's prometheus: "
                                    "scripts/system-packages.sh installs it as root with apt-get)")


def _promtool(*args, cwd=ROOT):
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@needs_promtool
def test_promtool_checks_the_rules_and_the_example_config():
    r = _promtool("check", "rules", RULES)
    assert r.returncode == 0 and "8 rules found" in r.stdout, r.stdout + r.stderr
    r = _promtool("check", "config", os.path.join(ROOT, "docs", "grafana", "prometheus.yml"))
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_promtool_rule_unit_tests_pass():
    r = _promtool("test", "rules", RULE_TESTS)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


@needs_promtool
def test_the_unit_tests_fail_when_a_rule_is_broken(tmp_path):
    """The unit tests can fail: an island-down threshold of 10 h instead of 30 min misses the island gone."""
    with open(RULES) as f:
        text = f.read()
    assert text.count("> 1800") == 1
    (tmp_path / "docs" / "grafana").mkdir(parents=True)
    (tmp_path / "docs" / "grafana" / "yeto-alerts.yml").write_text(text.replace("> 1800", "> 36000"))
    (tmp_path / "tests" / "ops").mkdir(parents=True)
    shutil.copy(RULE_TESTS, tmp_path / "tests" / "ops")
    r = _promtool("test", "rules", "tests/ops/yeto-alerts.test.yml", cwd=str(tmp_path))
    assert r.returncode != 0 and "YetoIslandDown" in r.stdout + r.stderr, r.stdout + r.stderr


def test_every_metric_a_rule_reads_is_exported():
    with open(RULES) as f:
        text = f.read()
    names = set(re.findall(r"\b(yeto_[a-z_]+)", text))
    have = exported()
    assert names and not names - set(have), sorted(names - set(have))
    # the alerts an operator is promised (README, docs/grafana/README.md)
    alerts = set(re.findall(r"- alert: (\w+)", text))
    assert {"YetoRoundsStalled", "YetoIslandDown", "YetoPushesRefused", "YetoSyncerUnreachableFromIsland",
            "YetoIslandWaiting", "YetoSyncerDown", "YetoIslandMetricsDown", "YetoMergesRefused"} == alerts

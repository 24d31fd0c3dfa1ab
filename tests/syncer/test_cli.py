"""The yeto-syncer command line: --help documents every flag, bad arguments fail clearly, a real process runs."""
import json
import logging
import os
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

from yeto_patch.syncer.cli import LOG_HANDLERS, build_parser, main
from yeto_patch.wire import codecs
from yeto_patch.wire.client import SyncerClient

from .helpers import MANIFEST, init_values

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _drop_cli_log_handlers():
    """main() in-process adds a stderr handler to the "yeto" logger; the test's stderr capture is closed after
    it, so later log lines of other tests' threads would print logging errors."""
    logger = logging.getLogger("yeto")
    level = logger.level
    yield
    for h in [h for h in logger.handlers if isinstance(h, LOG_HANDLERS)]:
        logger.removeHandler(h)
    logger.setLevel(level)


def test_help_lists_every_flag_with_its_default(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    flat = " ".join(text.split())
    p = build_parser()
    opts = [a for a in p._actions if a.option_strings and a.dest != "help"]
    assert len(opts) >= 30
    for a in opts:
        assert a.option_strings[-1] in text, a.option_strings
        assert a.help and len(a.help) > 10, a.dest
    assert flat.count("(default:") == len(opts)
    for flag in ("--listen", "--islands", "--fragments", "--key-file", "--checkpoint", "--quorum", "--grace",
                 "--round-timeout", "--outer", "--outer-lr", "--outer-momentum", "--delay", "--weights",
                 "--max-base-lag", "--late-factor", "--base-wire", "--checkpoint-every", "--background-checkpoint",
                 "--resume", "--metrics-port", "--log", "--tape", "--merge-threads", "--total-rounds", "--lease",
                 "--insecure"):
        assert flag in text


@pytest.mark.parametrize("args,msg", [
    (["--islands", "2", "--quorum", "3", "--insecure", "--listen", "127.0.0.1:0"], "quorum"),
    (["--insecure", "--listen", "0.0.0.0:0"], "loopback"),
    (["--listen", "127.0.0.1:0"], "no key"),
    (["--resume", "--insecure", "--listen", "127.0.0.1:0"], "--resume needs --checkpoint"),
])
def test_bad_arguments_exit_2_with_a_clear_message(args, msg, capsys, monkeypatch):
    monkeypatch.delenv("YETO_KEY", raising=False)
    assert main(args) == 2
    assert msg in capsys.readouterr().err


def test_base_wire_takes_sparse_names_as_typed():
    from yeto_patch.syncer.cli import config_from_args
    for typed, name in (("int4", "int4"), ("TopK:0.050+INT2", "topk:0.05+int2"), ("topk:.1+int8", "topk:0.1+int8")):
        a = build_parser().parse_args(["--base-wire", typed, "--insecure", "--listen", "127.0.0.1:0"])
        assert a.base_wire == name and config_from_args(a).base_wire == name


@pytest.mark.parametrize("typed", ["int4-log", "topk:0.7+int2", "topk:0.05+int3", "f16"])
def test_base_wire_refuses_what_cannot_carry_bases(typed, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--base-wire", typed, "--insecure", "--listen", "127.0.0.1:0"])
    assert e.value.code == 2
    assert "use f32, bf16, int8, int4, or topk:F+intB" in capsys.readouterr().err


def test_key_file_must_be_private(tmp_path, capsys):
    k = tmp_path / "k"
    k.write_text("s" * 40)
    os.chmod(k, 0o644)
    assert main(["--key-file", str(k), "--listen", "127.0.0.1:0"]) == 2
    assert "chmod 600" in capsys.readouterr().err


def test_cli_process_runs_a_small_run_with_metrics_tape_and_checkpoint(tmp_path):
    key = tmp_path / "yeto.key"
    key.write_text("0123456789abcdef0123456789abcdef\n")
    os.chmod(key, 0o600)
    ckpt, tape, logf = tmp_path / "s.bin", tmp_path / "tape.jsonl", tmp_path / "syncer.log"
    cmd = [sys.executable, "-m", "yeto_patch.syncer", "--listen", "127.0.0.1:0", "--islands", "1", "--fragments",
           "2", "--key-file", str(key), "--checkpoint", str(ckpt), "--checkpoint-every", "1", "--metrics-port", "0",
           "--metrics-addr", "127.0.0.1", "--tape", str(tape), "--log", str(logf), "--merge-threads", "2",
           "--final-ack-timeout", "10"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        addr = proc.stdout.readline().strip().rsplit(" ", 1)[-1]
        murl = proc.stdout.readline().strip().rsplit(" ", 1)[-1]
        c = SyncerClient(addr, b"0123456789abcdef0123456789abcdef", "solo", MANIFEST, timeout=20)
        w = c.connect()
        values = init_values()
        c.wait_ready(20, init_source=lambda f: [values[i] for i in w.layout[f]])
        for f in range(2):
            c.push(f, base_version=0, local_step=10, steps=10, tokens=1000, codec="int4", final=True,
                   body=codecs.encode("int4", np.full(w.numels[f], 0.01, np.float32)), wait=True)
        c.wait_base(0, 1, 20)
        body = urllib.request.urlopen(murl, timeout=10).read().decode()
        assert 'yeto_syncer_merges_total{fragment="0"} 1.0' in body
        assert "yeto_syncer_members 1.0" in body
        final = c.finish(last_step=10, timeout=20)
        assert [final[f].version for f in range(2)] == [1, 1]
        c.close()
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    recs = [json.loads(x) for x in tape.read_text().splitlines()]
    assert [r["fragment"] for r in sorted(recs, key=lambda r: r["fragment"])] == [0, 1]
    text = logf.read_text()
    assert "merged fragment 0 -> v1" in text and "final cut" in text
    assert ckpt.exists() and not os.path.exists(str(ckpt) + ".tmp")


def test_sigterm_checkpoints_committed_state_and_resume_refuses_to_overwrite(tmp_path):
    import signal

    from yeto_patch.syncer.model.checkpoint import read_checkpoint
    ckpt = tmp_path / "s.bin"
    cmd = [sys.executable, "-m", "yeto_patch.syncer", "--listen", "127.0.0.1:0", "--insecure", "--islands", "1",
           "--fragments", "2", "--checkpoint", str(ckpt), "--merge-threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        addr = proc.stdout.readline().strip().rsplit(" ", 1)[-1]
        c = SyncerClient(addr, None, "solo", MANIFEST, timeout=20, insecure=True)
        w = c.connect()
        values = init_values()
        c.wait_ready(20, init_source=lambda f: [values[i] for i in w.layout[f]])
        c.push(0, base_version=0, local_step=1, steps=1, tokens=1, codec="f32",
               body=codecs.encode("f32", np.full(w.numels[0], 0.5, np.float32)), wait=True)
        b = c.wait_base(0, 1, 20)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 130
        c.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    meta, arrays = read_checkpoint(str(ckpt))
    assert [f["version"] for f in meta["fragments"]] == [1, 0]
    assert np.array_equal(arrays[0]["base"], b.values)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--resume" in r.stderr

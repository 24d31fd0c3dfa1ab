"""`yeto-patch doctor` and the CLI dispatcher (the handshake against a real syncer is in test_doctor_handshake)."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def doctor(*args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_")}
    env["PYTHONPATH"] = ROOT
    env["PYTHONWARNINGS"] = "ignore"
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "yeto_patch.cli", "doctor", *args], env=env,
                          capture_output=True, text=True, timeout=180, cwd=ROOT)


def test_doctor_reports_configuration_versions_and_hooks():
    p = doctor("--no-handshake", env_extra={"YETO_DILOCO_SYNCER": "127.0.0.1:7640", "YETO_DILOCO_INSECURE": "1",
                                            "YETO_DILOCO_SYNC_EVERY": "25", "YETO_DILOCO_ISLAND_ID": "east"})
    out = p.stdout
    assert p.returncode == 0, out + p.stderr
    assert "attached by environment: yes" in out
    assert "sitecustomize bootstrap: active" in out
    assert "YETO_DILOCO_SYNC_EVERY         25" in out and "east" in out
    assert "megatron-core" in out and "torch" in out and "python" in out
    assert "mcore_optimizer" in out and re.search(r"\n +MixedPrecisionOptimizer\.step +patched\n", out), out
    assert re.search(r"\n +ChainedOptimizer\.step +patched\n", out), out
    assert re.search(r"\n +(save|load)_checkpoint +(patched|not installed)\n", out), out   # py311: no megatron.training
    assert "skipped (--no-handshake)" in out and out.rstrip().endswith("OK")


def test_doctor_names_a_bad_variable_and_fails():
    p = doctor("--no-handshake", "--no-import", env_extra={"YETO_DILOCO_SYNCER": "a:1,a:1"})
    assert p.returncode == 1
    assert "ERROR: YETO_DILOCO_SYNCER='a:1,a:1' lists an address twice" in p.stdout
    assert "PROBLEMS FOUND" in p.stdout


def test_doctor_unattached_says_how_to_attach():
    p = doctor("--no-handshake", "--no-import")
    assert "attached by environment: no (set YETO_DILOCO_SYNCER=host:port to attach)" in p.stdout
    assert p.returncode == 1   # no syncer address: nothing to attach to


def test_doctor_shows_the_launchers_writers_the_figures_and_the_name_mappings():
    p = doctor("--no-handshake", "--no-import", env_extra={"YETO_DILOCO_SYNCER": "127.0.0.1:7640",
                                                           "YETO_DILOCO_INSECURE": "1", "YETO_DILOCO_FIGURES": "0"})
    out = p.stdout
    section = out[out.index("launchers (recognised here"):]
    if re.search(r"Megatron-LM\s+recognised", section):   # megatron-core >= 0.17 ships megatron.training
        assert re.search(r"writer TensorBoard\s+get_tensorboard_writer\(\), with --tensorboard-dir; tensorboard "
                         r"(installed|not installed here)", section), section
        assert "writer W&B" in section
    assert "YETO_DILOCO_FIGURES            off (YETO_DILOCO_FIGURES=0)" in out
    mappings = out[out.index("name mappings"):]
    assert re.search(r"self_attention\.linear_qkv\.layer_norm_weight +-> input_layernorm\.weight", mappings)
    assert re.search(r"mlp\.linear_fc1\.layer_norm_weight +-> pre_mlp_layernorm\.weight", mappings)
    assert "mlp.experts.<global expert>.<rest>" in mappings and "[gate; up]" in mappings


def test_cli_dispatch():
    from yeto_patch import cli
    assert cli.main(["--help"]) == 0
    assert cli.main(["no-such-command"]) == 2
    assert cli._lazy_main("config") is None          # a module without main() is not a command
    assert cli._lazy_main("../etc") is None


def test_doctor_handshake_with_a_real_syncer(tmp_path):
    import time
    from tests.shim import procs as P
    port = P.free_port()
    key = P.key_file(tmp_path)
    syncer = P.start_syncer(tmp_path, port, islands=1, fragments=2, key=key)
    try:
        deadline = time.time() + 120
        while "listening" not in syncer.text() and time.time() < deadline:
            time.sleep(0.2)
        env = {"YETO_DILOCO_SYNCER": f"127.0.0.1:{port}", "YETO_DILOCO_KEY_FILE": key}
        p = doctor("--no-import", env_extra=env)
        assert p.returncode == 0, p.stdout + p.stderr
        assert f"OK: authenticated with 127.0.0.1:{port}" in p.stdout and "no run joined" in p.stdout
        assert "islands: 1" in p.stdout and "initialized: False" in p.stdout
        bad = P.key_file(tmp_path, "bad.key", "f" * 32)
        p = doctor("--no-import", env_extra={**env, "YETO_DILOCO_KEY_FILE": bad})
        assert p.returncode == 1 and "FAILED" in p.stdout and "auth" in p.stdout.lower()
        assert "members: []" not in syncer.text()
    finally:
        syncer.kill()


def test_doctor_probes_every_shard_of_a_sharded_syncer_in_order(tmp_path):
    import time
    from tests.shim import procs as P
    ports = [P.free_port() for _ in range(2)]
    key = P.key_file(tmp_path)
    shards = [P.start_syncer(tmp_path, p, islands=1, fragments=2, key=key, name=f"shard{i}", files=f"shard{i}",
                             extra=["--shard", f"{i}/2"]) for i, p in enumerate(ports)]
    try:
        deadline = time.time() + 120
        while not all("listening" in s.text() for s in shards) and time.time() < deadline:
            time.sleep(0.2)
        listed = [f"127.0.0.1:{p}" for p in ports]
        p = doctor("--no-import", env_extra={"YETO_DILOCO_SYNCER": ",".join(listed), "YETO_DILOCO_KEY_FILE": key})
        assert p.returncode == 0, p.stdout + p.stderr
        assert all(f"OK: authenticated with {a}" in p.stdout for a in listed)
        assert "shard: [0, 2]" in p.stdout and "shard: [1, 2]" in p.stdout
        p = doctor("--no-import", env_extra={"YETO_DILOCO_SYNCER": ",".join(listed[::-1]),
                                             "YETO_DILOCO_KEY_FILE": key})
        assert p.returncode == 1 and "lists it at position 0 of 2" in p.stdout, p.stdout
    finally:
        for s in shards:
            s.kill()

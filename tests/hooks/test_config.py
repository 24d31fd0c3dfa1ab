"""YETO_* configuration: defaults, every accepted form, and a clear error naming the variable for bad values."""
import dataclasses

import pytest

from yeto_patch import config
from yeto_patch.config import ConfigError, from_env

BASE = {"YETO_DILOCO_SYNCER": "syncer.example.org:7640", "YETO_DILOCO_KEY_FILE": "/secrets/yeto.key"}


def env(**kw):
    e = dict(BASE)
    for k, v in kw.items():
        if v is None:
            e.pop(k, None)
        else:
            e[k] = v
    return e


def test_defaults():
    s = from_env({**BASE, "MASTER_ADDR": "node17", "MASTER_PORT": "29500"})
    assert (s.syncer, s.syncer_host, s.syncer_port) == ("syncer.example.org:7640", "syncer.example.org", 7640)
    assert s.key_file == "/secrets/yeto.key" and not s.insecure
    assert s.island_id == "node17:29500" and s.island_id_default
    assert (s.sync_every, s.push_dtype, s.block, s.error_feedback) == (100, "int4", 256, None)   # None: auto
    assert (s.overlap_steps, s.merge_alpha, s.start_digest) == (5, 0.5, True)   # auto tau: min(5, H // 2)
    assert s.initializer is False
    assert (s.chunk_bytes, s.send_queue_bytes) == (64 << 20, 1 << 30)
    assert s.total_steps is None and s.vocab_size is None and s.metrics_path is None
    assert (s.timeout, s.log_level) == (600.0, "INFO")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.sync_every = 3


def test_auto_tau_and_error_feedback():
    """Unset (or `auto`): tau = min(5, H // 2), so H = 1 stays synchronous; error feedback is decided at the
    island's start (island/auto_settings.py); explicit values are kept."""
    for h, tau in ((1, 0), (2, 1), (3, 1), (10, 5), (100, 5)):
        assert from_env(env(YETO_DILOCO_SYNC_EVERY=str(h))).overlap_steps == tau
        assert from_env(env(YETO_DILOCO_SYNC_EVERY=str(h), YETO_DILOCO_OVERLAP_STEPS="auto")).overlap_steps == tau
    assert from_env(env(YETO_DILOCO_SYNC_EVERY="10", YETO_DILOCO_OVERLAP_STEPS="0")).overlap_steps == 0
    assert from_env(env(YETO_DILOCO_ERROR_FEEDBACK="AUTO")).error_feedback is None
    assert from_env(env(YETO_DILOCO_ERROR_FEEDBACK="0")).error_feedback is False


def test_sparse_push_dtype_is_canonicalised():
    assert from_env(env(YETO_DILOCO_PUSH_DTYPE=" TopK:0.020 + INT2 ")).push_dtype == "topk:0.02+int2"
    assert from_env(env(YETO_DILOCO_PUSH_DTYPE="topk:.1+int8", YETO_DILOCO_BLOCK="1024")).push_dtype == "topk:0.1+int8"


def test_the_block_must_suit_the_push_dtype():
    """A packed codec's block fills whole bytes: refused at start-up naming both variables, not at the first push."""
    assert from_env(env(YETO_DILOCO_PUSH_DTYPE="INT1", YETO_DILOCO_BLOCK="1024")).push_dtype == "int1"
    for dtype, block, per in (("int1", "12", 8), ("int4", "9", 2), ("int4-log", "255", 2)):
        with pytest.raises(ConfigError, match=rf"^YETO_DILOCO_BLOCK={block} does not suit "
                                              rf"YETO_DILOCO_PUSH_DTYPE={dtype}: .*multiple of {per}"):
            from_env(env(YETO_DILOCO_PUSH_DTYPE=dtype, YETO_DILOCO_BLOCK=block))
    assert from_env(env(YETO_DILOCO_PUSH_DTYPE="int8", YETO_DILOCO_BLOCK="9")).block == 9


def test_every_value_form():
    s = from_env(env(YETO_DILOCO_SYNC_EVERY="50", YETO_DILOCO_PUSH_DTYPE="INT4-LOG", YETO_DILOCO_BLOCK="128",
                     YETO_DILOCO_ERROR_FEEDBACK="yes", YETO_DILOCO_OVERLAP_STEPS="2",
                     YETO_DILOCO_MERGE_ALPHA="0.25", YETO_DILOCO_CHUNK_BYTES="16MiB",
                     YETO_DILOCO_SEND_QUEUE_BYTES="2G", YETO_DILOCO_TOTAL_STEPS="1000",
                     YETO_DILOCO_VOCAB_SIZE="50257", YETO_DILOCO_TIMEOUT="10m",
                     YETO_DILOCO_METRICS="/tmp/m-{island}.jsonl", YETO_DILOCO_ISLAND_ID="east-1",
                     YETO_DILOCO_LOG_LEVEL="debug", YETO_DILOCO_START_DIGEST="0", YETO_DILOCO_INITIALIZER="1"))
    assert (s.sync_every, s.push_dtype, s.block, s.error_feedback, s.overlap_steps) == (50, "int4-log", 128,
                                                                                        True, 2)
    assert (s.merge_alpha, s.chunk_bytes, s.send_queue_bytes) == (0.25, 16 << 20, 2 << 30)
    assert (s.total_steps, s.vocab_size, s.timeout) == (1000, 50257, 600.0)
    assert s.metrics_path == "/tmp/m-east-1.jsonl" and s.island_id == "east-1" and not s.island_id_default
    assert s.log_level == "DEBUG" and s.start_digest is False and s.initializer is True
    assert from_env(env(YETO_DILOCO_SYNCER="[::1]:7640", YETO_DILOCO_KEY_FILE=None,
                        YETO_DILOCO_INSECURE="1")).syncer == "[::1]:7640"
    assert from_env(env(YETO_DILOCO_KEY_FILE=None, YETO_KEY="s3cret")).key_source == "environment YETO_KEY"
    # a sharded syncer: every shard's address in shard order, normalised and comma-joined
    assert from_env(env(YETO_DILOCO_SYNCER=" s0:7640, s1:7641 ;[::1]:7642")).syncer == "s0:7640,s1:7641,[::1]:7642"
    with pytest.raises(ConfigError, match="loopback syncer address, not 's1'"):
        from_env(env(YETO_DILOCO_SYNCER="127.0.0.1:1,s1:2", YETO_DILOCO_KEY_FILE=None, YETO_DILOCO_INSECURE="1"))


@pytest.mark.parametrize("var,value,expect", [
    ("YETO_DILOCO_SYNCER", "a:1,b:2,a:1", "lists an address twice"),
    ("YETO_DILOCO_SYNCER", "a:1,b", "'b' is not an address"),
    ("YETO_DILOCO_SYNCER", ",".join(f"h{i}:1" for i in range(1025)), "at most 1024 syncer shards"),
    ("YETO_DILOCO_SYNCER", "syncer", "host:port"),
    ("YETO_DILOCO_SYNCER", "syncer:99999", "out of range"),
    ("YETO_DILOCO_SYNC_EVERY", "banana", "integer"),
    ("YETO_DILOCO_SYNC_EVERY", "0", "[1, "),
    ("YETO_DILOCO_PUSH_DTYPE", "int3", "f32, bf16, int8, int4, int4-log"),
    ("YETO_DILOCO_PUSH_DTYPE", "topk:0.7+int2", "topk:F+intB (F in 0.001..0.5"),
    ("YETO_DILOCO_PUSH_DTYPE", "topk:0.02+int3", "B in 2/4/8"),
    ("YETO_DILOCO_BLOCK", "4", "[8, 65536]"),
    ("YETO_DILOCO_ERROR_FEEDBACK", "maybe", "1/0"),
    ("YETO_DILOCO_START_DIGEST", "perhaps", "1/0"),
    ("YETO_DILOCO_OVERLAP_STEPS", "-1", "[0, "),
    ("YETO_DILOCO_OVERLAP_STEPS", "100", "smaller than YETO_DILOCO_SYNC_EVERY=100"),
    ("YETO_DILOCO_MERGE_ALPHA", "1.5", "[0.0, 1.0]"),
    ("YETO_DILOCO_MERGE_ALPHA", "nan", "[0.0, 1.0]"),
    ("YETO_DILOCO_CHUNK_BYTES", "12 parsecs", "K/M/G"),
    ("YETO_DILOCO_CHUNK_BYTES", "1K", "between 64KiB and 4GiB"),
    ("YETO_DILOCO_TOTAL_STEPS", "1e3", "integer"),
    ("YETO_DILOCO_TIMEOUT", "0", "seconds between 1"),
    ("YETO_DILOCO_TIMEOUT", "soon", "s/m/h"),
    ("YETO_DILOCO_LOG_LEVEL", "LOUD", "DEBUG, INFO, WARNING, ERROR"),
    ("YETO_DILOCO_ISLAND_ID", "has space", "1-64 characters"),
    ("YETO_DILOCO_INSECURE", "2", "1/0"),
    ("YETO_DILOCO_DISABLE", "sometimes", "1/0"),
    ("YETO_DILOCO_SYNC_EVRY", "10", "did you mean YETO_DILOCO_SYNC_EVERY"),
])
def test_bad_values_name_the_variable(var, value, expect):
    with pytest.raises(ConfigError) as ei:
        from_env(env(**{var: value}))
    msg = str(ei.value)
    assert msg.startswith(var) and expect in msg, msg


def test_key_and_insecure_rules():
    with pytest.raises(ConfigError, match="^YETO_DILOCO_KEY_FILE is not set"):
        from_env(env(YETO_DILOCO_KEY_FILE=None))
    with pytest.raises(ConfigError, match="^YETO_DILOCO_INSECURE=1 is only accepted with a loopback"):
        from_env(env(YETO_DILOCO_KEY_FILE=None, YETO_DILOCO_INSECURE="1"))
    s = from_env(env(YETO_DILOCO_SYNCER="localhost:7640", YETO_DILOCO_KEY_FILE=None, YETO_DILOCO_INSECURE="1"))
    assert s.insecure and s.key_source.startswith("none")


def test_auto_attach_without_address_fails_clearly():
    with pytest.raises(ConfigError, match="^YETO_DILOCO_SYNCER is not set"):
        from_env({"YETO_DILOCO_AUTO_ATTACH": "1"})
    assert from_env({"YETO_DILOCO_DISABLE": "1"}).disable


def test_attached_rule_matches_bootstrap():
    import importlib.util
    import os
    spec = importlib.util.spec_from_file_location("_boot", os.path.join(os.path.dirname(config.__file__), "..",
                                                                        "sitecustomize.py"))
    src = open(spec.origin).read()
    ns = {}
    exec(compile(src.replace("\n_bootstrap()\n", "\n"), spec.origin, "exec"), ns)
    cases = [{}, {"YETO_DILOCO_SYNCER": "a:1"}, {"YETO_DILOCO_SYNCER": " "}, {"YETO_DILOCO_AUTO_ATTACH": "1"},
             {"YETO_DILOCO_AUTO_ATTACH": "true", "YETO_DILOCO_DISABLE": "yes"},
             {"YETO_DILOCO_SYNCER": "a:1", "YETO_DILOCO_DISABLE": "0"}]
    for c in cases:
        assert ns["_configured"](c) == config.attached(c), c


def test_default_island_id_is_stable_and_shared_by_ranks():
    a = from_env({**BASE, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500", "RANK": "0"})
    b = from_env({**BASE, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500", "RANK": "7"})
    assert a.island_id == b.island_id == "10.0.0.5:29500"
    c = from_env({**BASE, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29501"})
    assert c.island_id.endswith(":29501") and not c.island_id.startswith("127.")


def test_get_reads_once_and_repeats_the_error(monkeypatch):
    config.reset()
    try:
        monkeypatch.setenv("YETO_DILOCO_SYNCER", "a:1,a:1")
        with pytest.raises(ConfigError, match="twice"):
            config.get()
        monkeypatch.setenv("YETO_DILOCO_SYNCER", "127.0.0.1:1")
        with pytest.raises(ConfigError, match="twice"):
            config.get()  # read once: the first outcome sticks
        config.reset()
        monkeypatch.setenv("YETO_DILOCO_INSECURE", "1")
        assert config.get() is config.get()
    finally:
        config.reset()


def test_docstring_table_lists_every_variable():
    for name, _default, _meaning in config.VARIABLES:
        assert f"\n{name} " in config.__doc__, name
    assert "int4" in config.__doc__ and "64MiB" in config.__doc__


# ------------------------------------------------------------------------------------------- the one table
def test_table_builds_settings_and_the_three_column_view():
    fields = [f.name for f in dataclasses.fields(config.Settings)]
    assert fields[:len(config.TABLE)] == [v.field for v in config.TABLE]           # one field per entry
    assert set(fields[len(config.TABLE):]) == {"syncer_host", "syncer_port", "island_id_default", "sync_auto"}
    assert [v[0] for v in config.VARIABLES] == [v.name for v in config.TABLE]
    assert len({v.name for v in config.TABLE}) == len(config.TABLE)
    defaults = {v.name: v.documented_default for v in config.TABLE}
    assert (defaults["YETO_DILOCO_CHUNK_BYTES"], defaults["YETO_DILOCO_SYNC_EVERY"],
            defaults["YETO_DILOCO_ERROR_FEEDBACK"], defaults["YETO_DILOCO_START_DIGEST"]) == ("64MiB", "100", "auto",
                                                                                                "1")
    s = from_env(BASE)
    for v in config.TABLE:   # an unset variable gives its table default (those resolved by rules aside)
        if v.field not in ("island_id", "syncer", "key_file", "overlap_steps"):
            assert getattr(s, v.field) == v.default, v.name


def test_doctor_rows_are_unchanged():
    s = from_env({**BASE, "MASTER_ADDR": "node17", "MASTER_PORT": "29500", "YETO_DILOCO_TIMEOUT": "90"})
    assert s.as_table() == [
        ("YETO_DILOCO_SYNCER", "syncer.example.org:7640"), ("key", "file /secrets/yeto.key"),
        ("YETO_DILOCO_ISLAND_ID", "node17:29500  (default)"), ("YETO_DILOCO_SYNC_EVERY", 100),
        ("YETO_DILOCO_PUSH_DTYPE", "int4"), ("YETO_DILOCO_BLOCK", 256), ("YETO_DILOCO_ERROR_FEEDBACK", "(auto)"),
        ("YETO_DILOCO_START_DIGEST", 1), ("YETO_DILOCO_INITIALIZER", 0), ("YETO_DILOCO_OVERLAP_STEPS", 5),
        ("YETO_DILOCO_MERGE_ALPHA", 0.5),
        ("YETO_DILOCO_CHUNK_BYTES", "64MiB"), ("YETO_DILOCO_SEND_QUEUE_BYTES", "1GiB"),
        ("YETO_DILOCO_TOTAL_STEPS", "(Megatron's train_iters)"), ("YETO_DILOCO_VOCAB_SIZE", "(tokenizer's, when known)"),
        ("YETO_DILOCO_TIMEOUT", "90s"), ("YETO_DILOCO_METRICS", "(unset)"), ("YETO_DILOCO_METRICS_PORT", "(unset)"),
        ("YETO_DILOCO_METRICS_ADDR", "127.0.0.1"), ("YETO_DILOCO_FIGURES", 1),
        ("YETO_DILOCO_LOG_LEVEL", "INFO")]
    rows = dict(from_env(env(YETO_DILOCO_KEY_FILE=None, YETO_KEY="s3cret", YETO_DILOCO_TOTAL_STEPS="7")).as_table())
    assert rows["key"] == "environment YETO_KEY" and rows["YETO_DILOCO_TOTAL_STEPS"] == 7
    assert "s3cret" not in repr(rows) and "s3cret" not in repr(from_env(env(YETO_KEY="s3cret")))


def test_readme_variable_table_is_the_generated_one():
    import os
    readme = open(os.path.join(os.path.dirname(config.__file__), "..", "README.md")).read()
    start = readme.index("<!-- generated by `python -m yeto_patch.config --markdown`")
    body = readme[readme.index("\n", start) + 1:readme.index("<!-- end of generated table -->")]
    assert body == config.markdown(), "README.md is stale: paste `python -m yeto_patch.config --markdown`"
    assert body.count("\n| `YETO_") == len(config.TABLE)


def test_markdown_command_prints_the_table(capsys):
    assert config._main(["--markdown"]) == 0
    assert capsys.readouterr().out == config.markdown()
    assert config._main(["--bogus"]) == 2


def test_island_timeout_is_no_longer_read_from_the_environment():
    import os
    src = open(os.path.join(os.path.dirname(config.__file__), "island", "masters", "collective.py")).read()
    assert "environ" not in src and "YETO_ISLAND_TIMEOUT_S" not in src

"""The island's start-time defaults (island/auto_settings.py): error feedback on for quantized pushes unless the
residual would take more than a quarter of rank 0's host memory; explicit settings kept."""
import logging

from yeto_patch.config import from_env
from yeto_patch.island import auto_settings

ENV = {"YETO_DILOCO_SYNCER": "127.0.0.1:7640", "YETO_DILOCO_INSECURE": "1"}
GiB = 1 << 30


def test_error_feedback_auto_rule():
    assert auto_settings.error_feedback("int4", 10**6, 64 * GiB)[0]
    assert auto_settings.error_feedback("bf16", 10**6, None)[0]          # memory unknown: on
    assert not auto_settings.error_feedback("f32", 10**6, 64 * GiB)[0]
    on, why = auto_settings.error_feedback("int4", 120 * 10**9, 1024 * GiB)   # 120B: 447 GiB of residual
    assert not on and "YETO_DILOCO_ERROR_FEEDBACK=1" in why and "447.0 GiB" in why
    assert auto_settings.error_feedback("int8", 100 * 10**9, 2048 * GiB)[0]  # 373 GiB < 512 GiB


def test_resolve_keeps_explicit_values_and_says_the_choice(caplog):
    s = from_env(ENV)
    assert s.error_feedback is None
    with caplog.at_level(logging.INFO, logger="yeto_patch"):
        on = auto_settings.resolve(s, 10**6, rank=0, memory=64 * GiB)
        off = auto_settings.resolve(s, 120 * 10**9, rank=0, memory=1024 * GiB)
        quiet = auto_settings.resolve(s, 10**6, rank=3, memory=64 * GiB)
    assert on.error_feedback is True and off.error_feedback is False and quiet.error_feedback is True
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "error feedback on" in said[0] and "error feedback off" in said[1]
    assert caplog.records[1].levelno == logging.WARNING
    for value, want in (("0", False), ("1", True)):
        explicit = from_env({**ENV, "YETO_DILOCO_ERROR_FEEDBACK": value})
        assert auto_settings.resolve(explicit, 120 * 10**9, rank=0, memory=GiB) is explicit
        assert explicit.error_feedback is want


def test_int1_and_sparse_pushes_without_error_feedback_are_warned(caplog):
    """int1 and top-k pushes lose what they do not send unless it is carried: an explicit 0, or an auto that turned
    it off for memory, is said on rank 0 with what to do; int4 with an explicit 0 is the user's call, quiet."""
    with caplog.at_level(logging.INFO, logger="yeto_patch"):
        for dtype in ("int1", "topk:0.05+int2"):
            explicit = from_env({**ENV, "YETO_DILOCO_ERROR_FEEDBACK": "0", "YETO_DILOCO_PUSH_DTYPE": dtype})
            assert auto_settings.resolve(explicit, 10**6, rank=0, memory=64 * GiB) is explicit
            auto_settings.resolve(explicit, 10**6, rank=1, memory=64 * GiB)
            off = auto_settings.resolve(from_env({**ENV, "YETO_DILOCO_PUSH_DTYPE": dtype}), 120 * 10**9, rank=0,
                                        memory=1024 * GiB)
            assert off.error_feedback is False
        auto_settings.resolve(from_env({**ENV, "YETO_DILOCO_ERROR_FEEDBACK": "0"}), 10**6, rank=0, memory=GiB)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 4, said
    assert "int1 pushes without error feedback (YETO_DILOCO_ERROR_FEEDBACK=0)" in said[0]
    assert "int1 pushes without it lose what they do not send: use int4" in said[1]
    assert "topk:0.05+int2 pushes without error feedback" in said[2] and "set it to 1 or use int4" in said[2]
    assert all(r.levelno == logging.WARNING for r in caplog.records)

"""The sitecustomize bootstrap, in fresh interpreters: attaches only when configured, never imports yeto-patch
otherwise, chains the sitecustomize it shadows, and never harms processes that do not train."""
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_py(code, env_extra=None, pythonpath=(ROOT,), timeout=120, cwd="/"):
    env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_") and k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    env["PYTHONWARNINGS"] = "ignore"
    env.update(env_extra or {})
    if code.startswith(REPORT):
        code = textwrap.dedent(REPORT) + textwrap.dedent(code[len(REPORT):])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


CONFIGURED = {"YETO_DILOCO_SYNCER": "127.0.0.1:7640", "YETO_DILOCO_INSECURE": "1"}

REPORT = """
    import json, sys
    def report(**extra):
        mods = sorted(m for m in sys.modules if m == "yeto_patch" or m.startswith("yeto_patch."))
        print(json.dumps(dict(mods=mods, sitecustomize=getattr(sys.modules.get("sitecustomize"), "__file__", None),
                              **extra)))
"""


def _last_json(p):
    import json
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_unconfigured_imports_nothing_of_yeto_patch():
    p = run_py(REPORT + "report()\n")
    out = _last_json(p)
    assert out["mods"] == []
    assert out["sitecustomize"] == os.path.join(ROOT, "sitecustomize.py")
    assert p.stderr == ""


@pytest.mark.parametrize("env", [
    {"YETO_DILOCO_DISABLE": "1", **CONFIGURED},
    {"YETO_DILOCO_AUTO_ATTACH": "0"},
    {"YETO_DILOCO_SYNCER": "  "},
    {"YETO_KEY": "x", "YETO_DILOCO_SYNC_EVERY": "5"},  # variables without an address do not attach
], ids=["disabled", "auto-attach-0", "blank-syncer", "no-syncer"])
def test_not_attached_imports_nothing(env):
    out = _last_json(run_py(REPORT + "report()\n", env))
    assert out["mods"] == []


def test_unconfigured_megatron_is_untouched():
    code = REPORT + """
    import wrapt
    import megatron.core.optimizer.optimizer as O
    report(wrapped=isinstance(vars(O.ChainedOptimizer)["step"], wrapt.ObjectProxy))
    """
    out = _last_json(run_py(code))
    assert out["mods"] == [] and out["wrapped"] is False


def test_configured_hooks_attach_when_megatron_is_imported():
    code = REPORT + """
    import yeto_patch.hooks as h
    before = h.patched()
    import megatron.core.optimizer
    import megatron.training.training as T  # py312 env only; absent on megatron-core 0.16
    report(before=before, after=h.patched(), installed=h.installed(), errors=h.errors())
    """ if _has_mlm() else REPORT + """
    import yeto_patch.hooks as h
    before = h.patched()
    import megatron.core.optimizer
    report(before=before, after=h.patched(), installed=h.installed(), errors=h.errors())
    """
    out = _last_json(run_py(code, CONFIGURED))
    assert out["installed"] and out["before"] == [] and out["errors"] == {}
    after = set(out["after"])
    assert "megatron.core.optimizer.optimizer.ChainedOptimizer.step" in after
    assert "megatron.core.optimizer.optimizer.MixedPrecisionOptimizer.step" in after
    assert "megatron.core.optimizer.optimizer.FP32Optimizer.step" in after
    if _has_mlm():
        assert "megatron.training.training.train_step" in after


def test_configured_bootstrap_imports_no_torch_and_no_megatron():
    code = REPORT + "report(heavy=sorted(m for m in ('torch', 'megatron', 'numpy') if m in sys.modules))\n"
    out = _last_json(run_py(code, CONFIGURED))
    assert out["heavy"] == []
    assert "yeto_patch.hooks" in out["mods"] and "yeto_patch.config" not in out["mods"]


def test_python_c_with_bad_values_is_unharmed():
    bad = {"YETO_DILOCO_SYNCER": "not an address", "YETO_DILOCO_SYNC_EVERY": "banana",
           "YETO_DILOCO_PUSH_DTYPE": "int3", "YETO_DILOCO_TYPO": "1"}
    p = run_py("import json; print(json.dumps(6 * 7))", bad)
    assert p.returncode == 0 and p.stdout.strip() == "42" and p.stderr == ""
    # importing megatron (as a data worker would) is harmless too
    p = run_py("import megatron.core.optimizer; print('ok')", bad)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr
    assert "yeto" not in p.stderr.lower()


def _shadowed(tmp_path, body):
    d = tmp_path / "site2"
    d.mkdir()
    (d / "sitecustomize.py").write_text(textwrap.dedent(body))
    return str(d)


def test_shadowed_sitecustomize_runs_as_if_imported(tmp_path):
    d = _shadowed(tmp_path, """
        import os, sys
        os.environ["SHADOWED_RAN"] = __name__ + "|" + __file__
        VALUE = 7
    """)
    code = REPORT + """
    import os, sitecustomize
    report(ran=os.environ.get("SHADOWED_RAN"), value=getattr(sitecustomize, "VALUE", None),
           ours=hasattr(sys.modules.get("yeto_patch_sitecustomize"), "__yeto_patch_bootstrap__"))
    """
    for env in ({}, CONFIGURED):
        out = _last_json(run_py(code, env, pythonpath=(ROOT, d)))
        assert out["ran"] == "sitecustomize|" + os.path.join(d, "sitecustomize.py")
        assert out["value"] == 7 and out["sitecustomize"] == os.path.join(d, "sitecustomize.py")
        assert out["ours"] is True
        assert (out["mods"] != []) == bool(env)


def test_failing_shadowed_sitecustomize_reports_and_continues(tmp_path):
    d = _shadowed(tmp_path, "raise RuntimeError('boom from the shadowed sitecustomize')\n")
    p = run_py(REPORT + "report()\n", CONFIGURED, pythonpath=(ROOT, d))
    out = _last_json(p)
    assert "Error in sitecustomize" in p.stderr and "boom from the shadowed sitecustomize" in p.stderr
    assert os.path.join(d, "sitecustomize.py") in p.stderr
    assert "yeto_patch.hooks" in out["mods"]  # our bootstrap still ran


def test_repeated_path_entry_does_not_recurse():
    out = _last_json(run_py(REPORT + "report()\n", CONFIGURED, pythonpath=(ROOT, ROOT, ROOT + "/")))
    assert out["sitecustomize"] == os.path.join(ROOT, "sitecustomize.py")


def _has_mlm():
    import importlib.util
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ModuleNotFoundError:
        return False

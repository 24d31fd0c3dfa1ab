"""The launch recipes (examples/slurm, examples/kubernetes) are checked, not just shown: the batch scripts pass
`bash -n`, the manifests parse as YAML and hang together (Service -> Deployment, the key Secret mounted 0400),
every YETO_* name is a variable of yeto_patch.config.TABLE, every syncer flag parses with the syncer's own
argparse parser, the torchrun flags with torchrun's, and pretrain_gpt.py's arguments with Megatron-LM's own
parser (megatron.training.arguments, where the venv has it)."""
import argparse
import glob
import os
import re
import shlex
import subprocess

import pytest
import yaml

from yeto_patch import config
from yeto_patch.syncer import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SBATCH = sorted(glob.glob(os.path.join(ROOT, "examples", "slurm", "*.sbatch")))
MANIFESTS = sorted(glob.glob(os.path.join(ROOT, "examples", "kubernetes", "*.yaml")))


def _read(path):
    with open(path) as f:
        return f.read()


def _docs(path):
    return [d for d in yaml.safe_load_all(_read(path)) if d]


def _shell_command(text, marker):
    """The shell command (continuation lines joined) that contains `marker`, as words."""
    for cmd in re.sub(r"\\\n", " ", text).splitlines():
        if marker in cmd and not cmd.lstrip().startswith("#"):
            return shlex.split(cmd, comments=True)
    raise AssertionError(f"no command with {marker!r}")


def _syncer_args(words):
    i = next(k for k, w in enumerate(words) if w in ("yeto_patch.syncer", "yeto-syncer"))
    args = []
    for w in words[i + 1:]:
        if w.startswith(("${", "$(")):   # (the conditional --resume: tested apart)
            break
        args.append(w)
    return args


def _check_syncer(args, where):
    parser = cli.build_parser()
    known = {o for a in parser._actions for o in a.option_strings}
    flags = [a for a in args if a.startswith("--")]
    assert flags and set(flags) <= known, (where, sorted(set(flags) - known))
    parsed = parser.parse_args([re.sub(r"^\$\{?\w+\}?$|^\"\$\w+\"$", "4", a) if a.startswith(("$", '"$')) else a
                                for a in args])
    assert parsed.checkpoint and parsed.metrics_port == 9464 and parsed.key_file, where


def _check_torchrun(words, where):
    from torch.distributed.run import get_args_parser
    i = words.index("torchrun")
    script = next(k for k, w in enumerate(words) if w.endswith("pretrain_gpt.py"))
    a = get_args_parser().parse_args([w if not w.startswith("$") else "4" for w in words[i + 1:script]]
                                     + ["x.py"])
    assert a.training_script == "x.py", where
    return words[script + 1:]


def _check_megatron(args, where):
    arguments = pytest.importorskip("megatron.training.arguments", reason="Megatron-LM's training package is not "
                                    "in this venv (py312 has it)")
    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    ns = parser.parse_args(args)   # an unknown or malformed flag exits (SystemExit) naming it
    assert ns.tensor_model_parallel_size == 4 and ns.pipeline_model_parallel_size == 2, where
    assert ns.bf16 and ns.use_distributed_optimizer and ns.save == ns.load, where


def test_the_recipes_are_there():
    names = {os.path.basename(p) for p in SBATCH + MANIFESTS}
    assert names == {"island.sbatch", "syncer.sbatch", "syncer.yaml", "island-job.yaml"}


@pytest.mark.parametrize("path", SBATCH, ids=os.path.basename)
def test_batch_scripts_parse_as_bash(path):
    r = subprocess.run(["bash", "-n", path], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "#SBATCH --job-name=" in _read(path)


def test_a_syntax_error_is_caught(tmp_path):
    bad = tmp_path / "bad.sbatch"
    bad.write_text(_read(SBATCH[0]) + "\nif true; then\n")
    assert subprocess.run(["bash", "-n", str(bad)], capture_output=True).returncode != 0


@pytest.mark.parametrize("path", SBATCH + MANIFESTS, ids=os.path.basename)
def test_every_yeto_name_is_a_known_variable(path):
    names = set(re.findall(r"\b(YETO_[A-Z0-9_]+)\b", _read(path)))
    known = {v.name for v in config.TABLE}
    assert not names - known, sorted(names - known)
    if "island" in os.path.basename(path):
        assert {"YETO_DILOCO_SYNCER", "YETO_DILOCO_KEY_FILE", "YETO_DILOCO_ISLAND_ID"} <= names


def test_slurm_syncer_flags_parse_with_the_syncers_parser():
    path = os.path.join(ROOT, "examples", "slurm", "syncer.sbatch")
    words = _shell_command(_read(path), "yeto_patch.syncer")
    assert words[-1] == "${resume[@]}" and "resume=(--resume)" in _read(path)
    _check_syncer(_syncer_args(words), path)


def test_slurm_island_launch_parses_with_torchrun_and_megatron():
    text = _read(os.path.join(ROOT, "examples", "slurm", "island.sbatch"))
    words = _shell_command(text, "pretrain_gpt.py")
    rest = _check_torchrun(words, "island.sbatch")
    assert rest == ['${GPT_ARGS[@]}']
    gpt = shlex.split(re.search(r"GPT_ARGS=\((.*?)\n\)", text, re.S).group(1), comments=True)
    _check_megatron(gpt, "island.sbatch")


def test_kubernetes_syncer_deployment_service_and_secret():
    docs = {d["kind"]: d for d in _docs(os.path.join(ROOT, "examples", "kubernetes", "syncer.yaml"))}
    assert set(docs) == {"PersistentVolumeClaim", "Deployment", "Service"}
    dep, svc = docs["Deployment"], docs["Service"]
    pod = dep["spec"]["template"]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    c = pod["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} == set(ports) and ports == {"wire": 7640, "metrics": 9464}
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert vols["key"]["secret"]["secretName"] == "yeto-key" and vols["key"]["secret"]["defaultMode"] == 0o400
    assert vols["state"]["persistentVolumeClaim"]["claimName"] == docs["PersistentVolumeClaim"]["metadata"]["name"]
    words = shlex.split(c["args"][0])
    assert c["args"][0].endswith("$(test -f /state/syncer.bin && echo --resume)")
    args = _syncer_args(words)
    assert any(a.startswith("/etc/yeto/") for a in args)
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/etc/yeto", "/state"}
    _check_syncer(args, "syncer.yaml")


def test_kubernetes_island_job():
    (job,) = _docs(os.path.join(ROOT, "examples", "kubernetes", "island-job.yaml"))
    assert job["kind"] == "Job"
    pod = job["spec"]["template"]["spec"]
    c = pod["containers"][0]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["YETO_DILOCO_SYNCER"].startswith("yeto-syncer.") and env["YETO_DILOCO_SYNCER"].endswith(":7640")
    assert env["YETO_DILOCO_KEY_FILE"].startswith("/etc/yeto/") and env["PYTHONPATH"] == "/opt/yeto-patch"
    settings = config.from_env({**env, "YETO_DILOCO_KEY_FILE": ""} | {"YETO_KEY": "0123456789abcdef0123"})
    assert settings.metrics_port == 9465 and settings.sync_every == 100
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["key"]["secret"] == {"secretName": "yeto-key", "defaultMode": 0o400}
    rest = _check_torchrun(c["command"], "island-job.yaml")
    assert rest == []
    _check_megatron([str(a) for a in c["args"]], "island-job.yaml")


def test_an_unknown_flag_is_caught():
    with pytest.raises(AssertionError):
        _check_syncer(["--listen", "0.0.0.0:7640", "--checkpoint-evry", "1"], "typo")
    with pytest.raises(SystemExit):
        _check_megatron(["--tensor-model-paralel-size", "4"], "typo")

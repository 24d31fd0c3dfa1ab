"""``yeto-patch`` console entry point.

    yeto-patch doctor [--no-handshake] [--timeout SECONDS]
        Resolved configuration, versions, whether the sitecustomize bootstrap is active, which hooks would attach
        in this environment, and an authenticated handshake with the syncer (a PROBE: it does not join a run).
        Exit status 0 when everything checked is in order, 1 otherwise.
    yeto-patch demo ...
        Two islands and a syncer on this machine (provided by ``yeto_patch.demo``; see ``yeto-patch demo --help``).

Further subcommands are found lazily: ``yeto-patch NAME`` runs ``yeto_patch.NAME.cli:main(argv)`` (or
``yeto_patch.NAME:main``) when that package exists, so adding one needs no change here.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import sys
import time

BUILTIN = {"doctor": "check configuration, versions, hooks and the syncer handshake"}
KNOWN_LAZY = {"demo": "run two islands and a syncer on this machine"}


def _lazy_main(name):
    """main(argv) of yeto_patch.<name>.cli or yeto_patch.<name>, or None when neither exists."""
    if not name.isidentifier() or name.startswith("_"):
        return None
    for modname in (f"yeto_patch.{name}.cli", f"yeto_patch.{name}"):
        try:
            if importlib.util.find_spec(modname) is None:
                continue
        except ModuleNotFoundError:
            continue
        mod = importlib.import_module(modname)
        fn = getattr(mod, "main", None)
        if callable(fn):
            return fn
    return None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        _usage(sys.stdout)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print("yeto-patch", _version("yeto-patch"))
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "doctor":
        return doctor(rest)
    fn = _lazy_main(cmd)
    if fn is None:
        if cmd in KNOWN_LAZY:
            print(f"yeto-patch: '{cmd}' is not available in this installation (yeto_patch.{cmd} is missing)",
                  file=sys.stderr)
        else:
            print(f"yeto-patch: unknown command {cmd!r}", file=sys.stderr)
            _usage(sys.stderr)
        return 2
    rc = fn(rest)
    return int(rc or 0)


def _usage(out):
    print("usage: yeto-patch COMMAND [ARGS]\n\ncommands:", file=out)
    for name, what in {**BUILTIN, **KNOWN_LAZY}.items():
        print(f"  {name:10s} {what}", file=out)


# ------------------------------------------------------------------------------------------------ doctor
def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _bootstrap_status():
    """Whether Python's `sitecustomize` is yeto-patch's bootstrap (or chains to it), and where it is."""
    mod = sys.modules.get("yeto_patch_sitecustomize") or sys.modules.get("sitecustomize")
    if mod is not None and getattr(mod, "__yeto_patch_bootstrap__", False):
        return True, f"active ({mod.__file__})"
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.exists(os.path.join(here, "sitecustomize.py")):
        return False, (f"NOT active in this process: put {here} first on PYTHONPATH in the training job's "
                       f"environment")
    return False, "NOT active: sitecustomize.py of yeto-patch is not next to the package (install from a checkout)"


def _print_launchers(out, surveyed: bool) -> None:
    """Which launchers this environment has, and which hooks attach for each (statuses from the survey, which
    sees the target modules the hook survey imported; ``surveyed`` False: --no-import)."""
    from yeto_patch import hooks
    status: dict = {}
    for name, t, st in (hooks.survey(import_targets=False) if surveyed else ()):
        status.setdefault(name, []).append(f"{t.name} {st}")
    print("\nlaunchers (recognised here, and the hooks that attach for each):", file=out)
    writers = hooks.writers()
    for launcher, dist, version, names in hooks.launchers():
        if version is None:
            print(f"  {launcher:36s} not installed ({dist})", file=out)
            continue
        print(f"  {launcher:36s} recognised: {dist} {version}", file=out)
        for name in names:
            print(f"    {name:34s} {'; '.join(status.get(name, ['not surveyed (--no-import)']))}", file=out)
        for writer, package, where in writers.get(launcher, ()):
            have = "installed" if _findable(package) else "not installed here"
            print(f"    {'writer ' + writer:34s} {where}; {package} {have}", file=out)


def _findable(package) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _print_figures(out, settings) -> None:
    on = settings is None or settings.figures
    print("\nfigures (the island's yeto/* scalars in the launcher's TensorBoard / W&B, written on the rank that "
          "holds the launcher's writer):", file=out)
    print(f"  {'YETO_DILOCO_FIGURES':30s} {'on' if on else 'off (YETO_DILOCO_FIGURES=0)'}"
          f"{'; into the writers listed under each launcher, when it opens them (none opened: none written)' if on else ''}",
          file=out)


def _print_name_mappings(out) -> None:
    """The names every island's manifest maps to megatron-core's local spec (island/masters/builds.py)."""
    from yeto_patch.island.masters import builds
    te = _version("transformer-engine")
    if te == "not installed":
        te = _version("transformer_engine")
    print("\nname mappings (any build to megatron-core's local-spec names, applied to islands built with "
          "Transformer Engine" + (f"; here: transformer-engine {te}" if te != "not installed" else
                                  "; none here: this environment builds the local spec's names") + "):", file=out)
    for b in builds.BUILD_NAMES:
        print(f"  {b.build:56s} -> {b.canonical}", file=out)
    print("  mlp.experts.local_experts.<j>.<rest> (SequentialMLP) and mlp.experts.<rest><j> (TEGroupedMLP) "
          "-> mlp.experts.<global expert>.<rest>", file=out)
    print("  linear_fc1 of a SwiGLU MLP (dense, shared or expert): [gate; up] across tensor-parallel ranks, "
          "whatever its partition_stride says", file=out)


def doctor(argv) -> int:
    """Check the configuration, versions, hooks and the syncer handshake of this environment."""
    ap = argparse.ArgumentParser(prog="yeto-patch doctor", description=doctor.__doc__)
    ap.add_argument("--no-handshake", action="store_true", help="skip the syncer handshake")
    ap.add_argument("--timeout", type=float, default=None,
                    help="handshake timeout in seconds (default: YETO_DILOCO_TIMEOUT, at most 30)")
    ap.add_argument("--no-import", action="store_true",
                    help="do not import Megatron to survey the hooks (faster; shows only what is installed)")
    a = ap.parse_args(argv)
    from yeto_patch import config
    ok = True
    out = sys.stdout

    print("yeto-patch doctor", file=out)
    attached = config.attached()
    print(f"  attached by environment: {'yes' if attached else 'no'}"
          f"{'' if attached else ' (set YETO_DILOCO_SYNCER=host:port to attach)'}", file=out)
    active, where = _bootstrap_status()
    print(f"  sitecustomize bootstrap: {where}", file=out)

    print("\nconfiguration:", file=out)
    settings = None
    try:
        settings = config.from_env()
        for k, v in settings.as_table():
            print(f"  {k:30s} {v}", file=out)
    except config.ConfigError as err:
        ok = False
        print(f"  ERROR: {err}", file=out)

    print("\nversions:", file=out)
    print(f"  {'python':30s} {platform.python_version()} ({sys.executable})", file=out)
    for dist in ("yeto-patch", "torch", "megatron-core", "megatron-bridge", "wrapt", "numpy", "xxhash"):
        print(f"  {dist:30s} {_version(dist)}", file=out)

    print("\nhooks (declared targets: patched / not patched / missing / not imported):", file=out)
    ok = _doctor_hooks(out, import_targets=not a.no_import) and ok

    _print_launchers(out, surveyed=not a.no_import)
    _print_figures(out, settings)
    _print_name_mappings(out)

    print("\nsyncer handshake:", file=out)
    if a.no_handshake:
        print("  skipped (--no-handshake)", file=out)
    elif settings is None or settings.syncer is None:
        ok = False
        print("  not attempted: no valid YETO_DILOCO_SYNCER", file=out)
    else:
        timeout = a.timeout if a.timeout is not None else min(settings.timeout, 30.0)
        try:
            lines = _handshake(settings, timeout)
            for line in lines:
                print(f"  {line}", file=out)
        except Exception as err:
            ok = False
            print(f"  FAILED: {type(err).__name__}: {err}", file=out)
    print(f"\n{'OK' if ok else 'PROBLEMS FOUND (see above)'}", file=out)
    return 0 if ok else 1


def _doctor_hooks(out, import_targets: bool) -> bool:
    """Print every declared hook target with its status, the supported versions and recorded hook errors;
    False when a required target is missing, a patch failed, or (after importing) nothing can attach."""
    from yeto_patch import hooks
    from yeto_patch.hooks import _targets
    ok = True
    t0 = time.time()
    rows = hooks.survey(import_targets=import_targets)
    versions = hooks.supported_versions()
    shown = set()
    for hook_name, target, status in rows:
        if hook_name not in shown:
            shown.add(hook_name)
            supported = []
            for dist, spec, have, fits in _targets.versions(versions.get(hook_name, {})):
                note = "" if fits is not False else "  WARNING: outside the supported range"
                supported.append(f"{dist} {spec}, here {have or 'not installed'}{note}")
            print(f"  {hook_name:28s} {target.module}  ({'; '.join(supported) or 'no version declared'})",
                  file=out)
        print(f"    {target.name:44s} {status}", file=out)
        if target.required and status.startswith("missing"):
            ok = False
    for where, why in sorted(hooks.errors().items()):
        ok = False
        print(f"  ERROR: {where}: {why}", file=out)
    if import_targets:
        if not any(status in ("patched", "not patched") for _, _, status in rows):
            ok = False
            print("  ERROR: no Megatron optimizer or training loop found to attach to", file=out)
        print(f"  (surveyed in {time.time() - t0:.1f}s)", file=out)
    return ok


def _handshake(settings, timeout):
    """Authenticated PROBE handshake with the syncer (every shard of a sharded one, in the order listed); lines
    describing what each answered."""
    try:
        from yeto_patch.wire import client as wire_client
    except ImportError as err:
        raise RuntimeError(f"the wire client is not available in this installation ({err})") from None
    probe = getattr(wire_client, "probe", None)
    if probe is None:
        raise RuntimeError("this wire client has no probe(); cannot check the syncer without joining a run")
    from yeto_patch.wire import auth
    key = None
    if not settings.insecure or settings.key_file or settings.key_from_env:
        key = auth.load_key(settings.key_file)
    lines = []
    addresses = settings.syncer.split(",")
    for i, address in enumerate(addresses):
        t0 = time.time()
        info = probe(address, key=key, island_id=settings.island_id, timeout=timeout, insecure=settings.insecure)
        ms = (time.time() - t0) * 1000
        lines.append(f"OK: authenticated with {address} in {ms:.0f} ms (probe; no run joined)")
        if isinstance(info, dict):
            shard = info.get("shard", [0, 1])
            if len(addresses) > 1 and list(shard) != [i, len(addresses)]:
                raise RuntimeError(f"{address} is syncer shard {shard}, but YETO_DILOCO_SYNCER lists it at "
                                   f"position {i} of {len(addresses)}: list every shard once, in shard order")
            for k in sorted(info):
                lines.append(f"{k}: {info[k]}")
        elif info is not None:
            lines.append(str(info))
    return lines


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""yeto-patch bootstrap, loaded by Python at start-up when this directory is on PYTHONPATH.

1. Runs the ``sitecustomize`` this file shadows (the next one along ``sys.path``), so an environment's own
   start-up code keeps working. It runs as module ``sitecustomize`` from its own file and stays in
   ``sys.modules["sitecustomize"]`` afterwards, exactly as if Python had imported it. If it raises, the error is
   printed the way Python prints a failing ``sitecustomize`` and start-up continues.
2. Only when yeto-patch is configured (``YETO_DILOCO_SYNCER`` set or ``YETO_DILOCO_AUTO_ATTACH=1``, and not
   ``YETO_DILOCO_DISABLE=1``) registers post-import hooks for the Megatron modules it patches
   (``yeto_patch.hooks.install()``). Nothing here imports torch or Megatron, and an unconfigured process imports
   nothing of yeto-patch. Configuration is validated later, when a process actually starts training, so data
   workers and ``python -c`` that inherit the variables are never harmed.
"""
import os as _os
import sys as _sys

__yeto_patch_bootstrap__ = True
_TRUE = ("1", "true", "yes", "on")


def _configured(env):
    if env.get("YETO_DILOCO_DISABLE", "").strip().lower() in _TRUE:
        return False
    return bool(env.get("YETO_DILOCO_SYNCER", "").strip()) or \
        env.get("YETO_DILOCO_AUTO_ATTACH", "").strip().lower() in _TRUE


def _shadowed_spec():
    """The spec of the next ``sitecustomize`` on sys.path after the last entry that is this file's directory."""
    from importlib.machinery import PathFinder
    me = _os.path.realpath(__file__)
    here = _os.path.dirname(me)
    later = []
    for entry in _sys.path:
        try:
            same = _os.path.realpath(entry or _os.getcwd()) == here
        except (OSError, ValueError):
            same = False
        later = [] if same else later + [entry]
    for entry in later:
        spec = PathFinder.find_spec("sitecustomize", [entry])
        if spec is not None and spec.origin and _os.path.realpath(spec.origin) != me:
            return spec
    return None


def _run_shadowed():
    import importlib.util
    try:
        spec = _shadowed_spec()
    except Exception:  # a broken sys.path entry must not stop the interpreter
        return
    if spec is None:
        return
    mine = _sys.modules.get("sitecustomize")
    module = importlib.util.module_from_spec(spec)
    _sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # what site.execsitecustomize does for a failing sitecustomize
        if mine is not None:
            _sys.modules["sitecustomize"] = mine
        if _sys.flags.verbose:
            _sys.excepthook(*_sys.exc_info())
        else:
            _sys.stderr.write("Error in sitecustomize (%s, shadowed by yeto-patch); set PYTHONVERBOSE for "
                              "traceback:\n%s: %s\n" % (spec.origin, type(err).__name__, err))
        return
    # keep the shadowed module as `sitecustomize` (as if imported normally); ours stays reachable
    if mine is not None:
        _sys.modules["yeto_patch_sitecustomize"] = mine


def _bootstrap():
    _run_shadowed()
    if not _configured(_os.environ):
        return
    try:
        import yeto_patch.hooks
        yeto_patch.hooks.install()
    except Exception as err:  # never break interpreter start-up (this runs in every process), but say so loudly
        _sys.stderr.write("yeto-patch: could not register its hooks, this process runs WITHOUT DiLoCo: "
                          "%s: %s\n" % (type(err).__name__, err))


_bootstrap()

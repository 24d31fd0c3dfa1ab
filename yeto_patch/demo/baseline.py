"""The synchronous data-parallel baseline: the same script, the same tokens as all islands together, no yeto-patch.

Its result is cached under ``cache_dir/<hash of everything that changes it>/`` (the training flags, the
training script and data code, the text it reads, the Python / torch / megatron-core versions), so a second
demo with the same settings reuses it.
"""
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil

__all__ = ["baseline_key", "cached", "store", "default_cache_dir"]


def default_cache_dir():
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "yeto-patch",
                        "demo-baseline")


def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _file_digest(paths):
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def baseline_key(train_flags, nproc, code_paths, corpus_desc, python):
    """A short hash of everything that changes the baseline's result."""
    ident = {
        "flags": list(train_flags), "nproc": nproc, "code": _file_digest(code_paths), "corpus": corpus_desc,
        "python": python or platform.python_version(), "torch": _version("torch"),
        "megatron-core": _version("megatron-core"),
    }
    blob = json.dumps(ident, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:20], ident


def cached(cache_dir, key, extra=()):
    """Path of the cached baseline JSONL for `key`, or None (also None when a file named in `extra`, e.g. a
    warm-up snapshot, is not cached beside it)."""
    d = os.path.join(cache_dir, key)
    path = os.path.join(d, "baseline.jsonl")
    if os.path.exists(os.path.join(d, "complete")) and os.path.exists(path) and \
            all(os.path.exists(os.path.join(d, n)) for n in extra):
        return path
    return None


def store(cache_dir, key, ident, jsonl_path, extra=None):
    """Copy a finished baseline into the cache (atomically: a folder renamed into place). `extra`: {name: path}
    of further files (warm-up snapshots); those an earlier run cached under the same key are kept."""
    d = os.path.join(cache_dir, key)
    tmp = f"{d}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    if os.path.exists(os.path.join(d, "complete")):
        for n in os.listdir(d):
            if n.startswith("warm-"):
                shutil.copyfile(os.path.join(d, n), os.path.join(tmp, n))
    for n, p in (extra or {}).items():
        shutil.copyfile(p, os.path.join(tmp, n))
    shutil.copyfile(jsonl_path, os.path.join(tmp, "baseline.jsonl"))
    with open(os.path.join(tmp, "settings.json"), "w") as f:
        json.dump(ident, f, indent=1, sort_keys=True)
    open(os.path.join(tmp, "complete"), "w").close()
    shutil.rmtree(d, ignore_errors=True)
    os.replace(tmp, d)
    return os.path.join(d, "baseline.jsonl")

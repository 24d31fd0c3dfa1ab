"""Megatron-aware island layer: global names, FP32 master read/write, host (gloo) collectives.

    comm = IslandComm()                                    # every rank
    manifest = build_manifest(model_chunks, real_vocab_size=V, comm=comm)
    view = MasterView(model_chunks, optimizer, manifest, chunk_bytes=4 << 20, comm=comm)
    view.read(indices, sink)          # rank 0: sink(index, offset, float32 array); others: view.read()
    view.write(indices, source)       # rank 0: source(index, offset, count) -> float32 array; others: view.write()

Imports torch lazily: the names below are imported on first use (PEP 562), so a torch-free submodule
(``masters.builds``, ``boundary.log``) can be imported without torch (``yeto-patch doctor``); nothing here
touches an accelerator.
"""
import importlib

_EXPORTS = {
    "yeto_patch.island.masters.collective": ("IslandComm", "IslandError"),
    "yeto_patch.island.masters.view": ("MasterView", "collect_arrays"),
    "yeto_patch.island.masters.refs": ("find_masters",),
    "yeto_patch.island.masters.names": ("build_manifest",),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = ["IslandComm", "IslandError", "MasterView", "collect_arrays", "find_masters", "build_manifest"]


def __getattr__(name):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

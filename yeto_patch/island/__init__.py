"""Megatron-aware island layer: global names, FP32 master read/write, host (gloo) collectives.

    comm = IslandComm()                                    # every rank
    manifest = build_manifest(model_chunks, real_vocab_size=V, comm=comm)
    view = MasterView(model_chunks, optimizer, manifest, chunk_bytes=4 << 20, comm=comm)
    view.read(indices, sink)          # rank 0: sink(index, offset, float32 array); others: view.read()
    view.write(indices, source)       # rank 0: source(index, offset, count) -> float32 array; others: view.write()

Imports torch lazily through its submodules; nothing here touches an accelerator.
"""
from yeto_patch.island.masters.collective import IslandComm, IslandError
from yeto_patch.island.masters.view import DEFAULT_CHUNK_BYTES, MasterView, collect_arrays, find_masters
from yeto_patch.island.masters.names import Entry, LocalParam, Manifest, ManifestError, build_manifest, local_params

__all__ = ["IslandComm", "IslandError", "MasterView", "DEFAULT_CHUNK_BYTES", "collect_arrays", "find_masters",
           "Entry", "LocalParam", "Manifest", "ManifestError", "build_manifest", "local_params"]

"""What an island's ranks hold, named and read the same way on every layout: global names and the manifest
(names.py), the island's gloo collectives (collective.py), and the FP32 master view (view.py) with its reads,
writes and staged installs (read.py, write.py, stage.py) over the agreed layout (layout.py, refs.py)."""

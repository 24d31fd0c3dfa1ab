"""Island rank 0's link to the syncer: one syncer (syncer.py) or a sharded one (sharded.py), both implementing the
contract the engine uses (protocol.py)."""

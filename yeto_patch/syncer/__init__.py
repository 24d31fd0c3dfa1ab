"""The syncer: rounds per fragment, merge, outer optimizer, checkpoints, metrics and the ``yeto-syncer`` CLI."""

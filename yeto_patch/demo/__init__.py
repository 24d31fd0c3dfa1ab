"""``yeto-patch demo``: a syncer and two islands of a small real megatron-core GPT on this machine.

Entry points: ``yeto-patch demo [options]`` (dispatched by ``yeto_patch.cli``), ``python -m yeto_patch.demo``,
or ``yeto_patch.demo.main(argv)``. See ``yeto-patch demo --help``.
"""


def main(argv=None):
    from .cli import main as _main
    return _main(argv)

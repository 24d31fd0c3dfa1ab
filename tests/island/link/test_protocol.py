"""The link contract: one syncer (SyncerLink) and a sharded one (ShardedLink) implement every member of
SyncerLinkLike with the same signature, so the engine can use either."""
import inspect

from yeto_patch.island.records import SyncerLinkLike
from yeto_patch.island.link.sharded import ShardedLink
from yeto_patch.island.link.syncer import SyncerLink


def members():
    return [n for n, v in vars(SyncerLinkLike).items() if not n.startswith("_") and (callable(v) or
                                                                                     isinstance(v, property))]


def mismatches(cls) -> list:
    """Members of the contract that `cls` lacks or has with another signature."""
    out = []
    for name in members():
        want, got = getattr(SyncerLinkLike, name), getattr(cls, name, None)
        if got is None:
            out.append(f"{cls.__name__} lacks {name}")
        elif isinstance(want, property) != isinstance(got, property):
            out.append(f"{cls.__name__}.{name}: property or not")
        elif not isinstance(want, property) and \
                list(inspect.signature(got).parameters) != list(inspect.signature(want).parameters):
            out.append(f"{cls.__name__}.{name}{inspect.signature(got)} is not {inspect.signature(want)}")
    return out


def test_both_links_implement_every_member_with_the_contracts_signature():
    assert {"send_push", "poll", "final_model", "final_cut", "run_ids"} <= set(members())
    assert "resilient" in SyncerLinkLike.__annotations__
    assert mismatches(SyncerLink) == [] and mismatches(ShardedLink) == []


def test_the_check_names_a_link_that_differs():
    class Partial(ShardedLink):
        def poll(self, timeout):   # a signature the engine does not call
            pass
        final_cut = False
    got = mismatches(Partial)
    assert len(got) == 2 and got[0] == "Partial.final_cut: property or not"
    assert got[1].startswith("Partial.poll(self, timeout) is not (self)")

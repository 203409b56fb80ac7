"""dist/objects.py: Python objects between ranks as pickles, and the tensors given to a collective
kept by Python while a work holds them. The deadlock this prevents (torch < 2.8: a gloo group freed
with the GIL held while its worker waits for the GIL to free a tensor's Python object) is shown by
tests/test_dist.py::test_normal_ends_in_a_row_never_hang at the floor; here, what makes it
impossible, on fakes of torch.distributed's calls.

Run: python -m pytest -q tests/test_objects.py"""
import pickle

import pytest
import torch

from dlojzlib import compat
from dlojzlib.dist import launch, objects


class TwoRanks:
    """torch.distributed's calls as `rank` of 2 sees them, the other rank sending `other`. Each
    tensor a call is given stays held by a work until the test lets go: a view holds its base's
    TensorImpl from C++, as a gloo work does (compat.use_count counts it)."""

    def __init__(self, other, rank):
        self.other, self.rank = pickle.dumps(other), rank
        self.given, self.works = [], []

    def _hold(self, *tensors):
        self.given += tensors
        self.works += [t.view(-1) for t in tensors]

    def _fill(self, t):  # the other rank's part: its pickle's length, or its pickle padded
        if t.dtype == torch.long:
            t.fill_(len(self.other))
        else:
            t.zero_()
            t[:len(self.other)] = torch.tensor(list(self.other), dtype=torch.uint8)

    def all_gather(self, out, tensor, group=None):
        self._hold(tensor, *out)
        out[self.rank].copy_(tensor)
        self._fill(out[1 - self.rank])

    def broadcast(self, tensor, src, group=None):
        self._hold(tensor)
        if src != self.rank:
            self._fill(tensor)


@pytest.fixture
def two_ranks(monkeypatch):
    def make(other, rank=0):
        fake = TwoRanks(other, rank)
        tdist = launch.tdist  # torch.distributed, as objects.py reaches it too
        for name, value in [('is_initialized', lambda: True), ('get_world_size', lambda *g: 2),
                            ('get_rank', lambda *g: rank), ('get_backend', lambda *g: 'gloo'),
                            ('all_gather', fake.all_gather), ('broadcast', fake.broadcast)]:
            monkeypatch.setattr(tdist, name, value)
        return fake
    return make


def test_a_work_holding_a_tensor_keeps_it_and_its_end_lets_it_go():
    t = torch.zeros(4)
    work = t.view(-1)
    assert compat.use_count(t) == 2
    objects.keep(t)
    objects.keep()  # a later call: t is still held by the work
    assert objects.kept(t)
    del work
    objects.keep()
    assert not objects.kept(t)


@pytest.mark.parametrize('rank', [0, 1])
def test_objects_of_two_lengths_are_gathered_in_rank_order_and_their_tensors_kept(two_ranks, rank):
    mine, other = {'rank': rank, 'times': [0.5] * 30}, 'short'
    fake = two_ranks(other, rank)
    got = launch.all_gather_object(mine)
    assert got == ([mine, other] if rank == 0 else [other, mine])
    assert len(fake.given) == 6  # sizes (in, 2 out), pickles (in, 2 out)
    assert all(objects.kept(t) for t in fake.given)  # each held by its work, so kept
    fake.works.clear()
    objects.keep()
    assert not any(objects.kept(t) for t in fake.given)


@pytest.mark.parametrize('rank', [0, 1])
def test_rank_0s_object_reaches_every_rank_and_its_tensors_are_kept(two_ranks, rank):
    fake = two_ranks(['from', 'rank', 0], rank)
    assert launch.broadcast_object(['from', 'rank', rank]) == ['from', 'rank', 0]
    assert len(fake.given) == 2 and all(objects.kept(t) for t in fake.given)
    fake.works.clear()
    objects.keep()
    assert not any(objects.kept(t) for t in fake.given)


def test_an_all_reduced_tensor_and_the_stop_flag_are_kept_while_their_works_hold_them(
        two_ranks, monkeypatch):
    two_ranks(None)
    works = []

    class Work:  # a gloo work: holds its tensor until the test lets go
        def __init__(self, t):
            works.append(t.view(-1))

        def wait(self):
            pass

    monkeypatch.setattr(launch.tdist, 'all_reduce', lambda t, *a, **k: Work(t))
    total = launch.all_reduce_(torch.ones(2))
    stop = launch.StopSignal()  # no handler installed: agreed() only starts the all-reduce
    assert stop.agreed() is False
    flag = stop._flag
    objects.keep()
    assert objects.kept(total) and objects.kept(flag)
    works.clear()
    objects.keep()
    assert not objects.kept(total) and not objects.kept(flag)

"""gc_paused: the cyclic collector is off inside the block and as it was after, whatever happens."""

import gc

import pytest

from tlm_tokenizer._gc import gc_paused


@pytest.fixture
def collector():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


def test_off_inside_and_back_on_after(collector):
    gc.enable()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_back_on_after_an_exception(collector):
    gc.enable()
    with pytest.raises(KeyError), gc_paused():
        raise KeyError("x")
    assert gc.isenabled()


def test_left_off_when_it_was_off(collector):
    gc.disable()
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()

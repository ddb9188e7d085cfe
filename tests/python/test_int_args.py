"""Integers the binding hands the C library (arguments and struct fields):
ctypes wraps a Python int beyond the C type silently (world_size 2**32 + 1
ran as 1, steps 2**64 + 5 as 5, grads_part's first 2**64 + 4 as 4) and
int() cut 2.9 to 2. Each is INVALID naming the argument; in-range values,
the edges and numpy/torch integer scalars work. Values the C type holds but
the API refuses (world_size -1, steps 2^63-1) stay the library's INVALID.
The bad addresses here wrap, before the fix, onto the buffer's own address
(address +- 2**64): the old binding ran them, where one of another value
(a bool's 1, -8) would have read unmapped memory and crashed the run."""
import re

import numpy as np
import pytest

import strata

try:
    import torch
except ImportError:  # the torch scalars' cases are skipped
    torch = None

U64 = 2**64
C_INT, INT64, UINT64 = (-2**31, 2**31 - 1), (-2**63, 2**63 - 1), (0, 2**64 - 1)


def torch_int(v):
    if torch is None:
        pytest.skip("no torch")
    return torch.tensor(v)


def beyond(value, ctype):
    """`value` when it is an int that the C type cannot hold (its message must
    say it as given, not wrapped), else None."""
    plain = isinstance(value, int) and not isinstance(value, bool)
    return value if plain and not ctype[0] <= value <= ctype[1] else None


def refused(fn, name, value=None):
    """fn() raises INVALID whose message names `name` (and `value` as given,
    not as ctypes would wrap it, when not None)."""
    with pytest.raises(strata.Error) as err:
        fn()
    assert err.value.status == strata.INVALID, err.value
    assert name in err.value.message, err.value
    if value is not None:
        assert re.search(rf"(?<![-\d]){value}(?!\d)", err.value.message), err.value
    return err.value


def engine(**kw):
    cfg = kw.pop("config", {})
    return strata.Engine(cfg, force_no_gpu=True, **kw)


@pytest.fixture
def built():
    """A built engine without a GPU: one group of 8 elements, an activation store."""
    e = engine(config={"strata": {"activation_host_bytes": "1MiB"}}, skip_groups_without_grads=True)
    e.add_param(0, "w", np.ones(8, np.float32))
    e.build()
    yield e
    e.close()


# -- strata.Engine's options (c_int fields of strata_engine_options_t)

BAD_OPTIONS = [("world_size", 2**32 + 1), ("world_size", 2**31), ("world_size", 2.9), ("world_size", "2"),
               ("world_size", True), ("world_size", np.float64(1.0)),
               ("rank", 2**32), ("rank", -2**31 - 1), ("rank", 0.0),
               ("grad_accumulation_steps", 2**32 + 2), ("grad_accumulation_steps", 2.0),
               ("device", 2**32 - 1), ("device", -2**32 - 1), ("device", -1.0),
               # held by a C int, refused by the library as before (its message)
               ("world_size", -1), ("rank", -1), ("grad_accumulation_steps", 0), ("device", -2)]


@pytest.mark.parametrize("name,value", BAD_OPTIONS, ids=[f"{n}={v!r}" for n, v in BAD_OPTIONS])
def test_engine_option_refused(name, value):
    refused(lambda: engine(**{name: value}).close(), name, beyond(value, C_INT))


@pytest.mark.parametrize("kw", [dict(world_size=1), dict(world_size=np.int64(1)), dict(rank=0, world_size=1),
                                dict(world_size=1, rank=np.int32(0)), dict(device=-1), dict(device=2**31 - 1),
                                dict(grad_accumulation_steps=2**31 - 1)])
def test_engine_option_accepted(kw):
    with engine(**kw) as e:
        assert e.placement.startswith("rank 0/1:")


@pytest.mark.parametrize("accum", [2, np.int64(2), "torch"])
def test_grad_accumulation_steps_divides(accum):
    """2 (or an integer scalar of 2) divides the gradients' sum by 2."""
    accum = torch_int(2) if accum == "torch" else accum
    with engine(grad_accumulation_steps=accum) as e:
        e.add_param(0, "w", np.ones(4, np.float32))
        e.build()
        e.grads(0, np.ones(4, np.float32))
        assert e.grad_norm() == pytest.approx(1.0)  # |(1,1,1,1)| / 2


# -- step counts (int64_t): the steps setter and set_group_steps

BAD_STEPS = [U64 + 5, 2**63, -2**63 - 1, 2.9, 3.0, "3", True, np.float64(3.0), -1, 2**63 - 1]


@pytest.mark.parametrize("kind", ["steps", "set_group_steps"])
@pytest.mark.parametrize("value", BAD_STEPS, ids=repr)
def test_steps_refused(built, kind, value):
    built.steps = 4
    set_it = (lambda: setattr(built, "steps", value)) if kind == "steps" else \
        (lambda: built.set_group_steps(0, value))
    refused(set_it, "steps", beyond(value, INT64))
    assert built.steps == 4 and built.group_steps(0) == 4


@pytest.mark.parametrize("kind", ["steps", "set_group_steps"])
@pytest.mark.parametrize("value,want", [(0, 0), (1, 1), (2**63 - 2, 2**63 - 2), (np.int64(7), 7),
                                        (np.uint8(9), 9), ("torch", 5)], ids=repr)
def test_steps_accepted(built, kind, value, want):
    value = torch_int(5) if isinstance(value, str) else value
    if kind == "steps":
        built.steps = value
        assert built.steps == want
    else:
        built.set_group_steps(0, value)
    assert built.group_steps(0) == want


# -- grads_part: first, and an (address, count) part (uint64_t; a pointer)

def _part(kind, value):
    """grads_part's arguments with `value` put where `kind` says."""
    g = np.ones(4, np.float32)
    if kind == "first":
        return value, g, None
    if kind == "count":
        return 0, (g.ctypes.data, value), "f32"
    return 0, (value(g) if callable(value) else value, 4), "f32"  # the address


BAD_PARTS = [("first", U64 + 4, "first"), ("first", -1, "first"), ("first", 4.0, "first"),
             ("first", np.float32(4), "first"), ("first", True, "first"),
             ("count", U64 + 4, "count"), ("count", -4, "count"), ("count", 4.0, "count"),
             ("address", lambda g: U64 + g.ctypes.data, "address"),
             ("address", lambda g: g.ctypes.data - U64, "address"), ("address", 8.0, "address")]


PART_IDS = [f"{k}={'buffer+-2**64' if callable(v) else repr(v)}" for k, v, _ in BAD_PARTS]


@pytest.mark.parametrize("lend", [False, True])
@pytest.mark.parametrize("kind,value,name", BAD_PARTS, ids=PART_IDS)
def test_grads_part_refused(built, lend, kind, value, name):
    first, grads, dtype = _part(kind, value)
    err = refused(lambda: built.grads_part(0, first, grads, dtype=dtype, lend=lend), name, beyond(value, UINT64))
    if not isinstance(value, float):  # (a float address: _address's message, "expected ... an address")
        assert err.message.startswith("grads_part"), err
    with pytest.raises(strata.Error) as end:  # nothing was given: no call in parts is open
        built.grads_end(0)
    assert end.value.status == strata.STATE, end.value
    assert not built._lent


def test_grads_part_message():
    with engine() as e:
        e.add_param(0, "w", 8)
        e.build()
        err = refused(lambda: e.grads_part(0, U64 + 4, np.ones(4, np.float32)), "first")
        assert err.message == "grads_part: first 18446744073709551620 is outside 0..2^64-1"


@pytest.mark.parametrize("first", [7, np.int64(7), np.uint64(7), "torch"], ids=repr)
def test_grads_part_last_element(built, first):
    first = torch_int(7) if isinstance(first, str) else first
    g = np.full(1, 3.0, np.float32)
    built.grads_part(0, first, (g.ctypes.data, np.int64(1)), dtype="f32")
    built.grads_end(0)
    assert built.grad_norm() == pytest.approx(3.0)
    assert built.grads_view(0)[7].item() == 3.0


# -- activations: stash/redeem/drop_stash (bytes, handles: uint64_t; addresses)

def test_stash_redeem_refused(built):
    src = np.arange(64, dtype=np.uint8)
    out = np.zeros(64, np.uint8)
    for nbytes in (U64 + 8, -8, 8.0, np.float64(8), "8", True):
        refused(lambda: built.stash(src.ctypes.data, nbytes=nbytes), "nbytes", beyond(nbytes, UINT64))
        refused(lambda: built.stash(src, nbytes=nbytes), "nbytes", beyond(nbytes, UINT64))
    for address in (U64 + src.ctypes.data, src.ctypes.data - U64):
        refused(lambda: built.stash(address, nbytes=64), "stash", address)
    refused(lambda: built.stash(src, nbytes=0), "0 bytes")  # held by a uint64_t: the library's message
    h = built.stash(src.ctypes.data, nbytes=64)
    for nbytes in (U64 + 64, -64, 64.0):
        refused(lambda: built.redeem(h, out.ctypes.data, nbytes=nbytes), "nbytes", beyond(nbytes, UINT64))
    for handle in (U64 + h, -1, float(h), str(h), True):
        refused(lambda: built.redeem(handle, out), "handle", beyond(handle, UINT64))
        refused(lambda: built.drop_stash(handle), "handle", beyond(handle, UINT64))
    refused(lambda: built.redeem(h, U64 + out.ctypes.data, nbytes=64), "redeem")
    assert not out.any()  # nothing was copied: the stash is still there
    built.redeem(np.uint64(h), out.ctypes.data, nbytes=np.int64(64))
    assert (out == src).all()


def test_stash_accepted(built):
    src = np.arange(64, dtype=np.uint8)
    out = np.zeros(64, np.uint8)
    h = built.stash(src.ctypes.data, nbytes=np.int64(64))
    built.redeem(h, out)
    assert (out == src).all()
    h = built.stash(src, nbytes=1)  # the edge: one byte
    one = np.zeros(1, np.uint8)
    built.redeem(h, one, nbytes=1)
    built.drop_stash(built.stash(src))
    assert one[0] == src[0]


# -- strata.adam_step: options.step (int64_t), the arrays' addresses

BAD_ADAM = [U64 + 1, 2**63, -2**63 - 1, 1.0, 2.9, np.float64(1.0), "1", True, 0, -1]


@pytest.mark.parametrize("step", BAD_ADAM, ids=repr)
def test_adam_step_refused(step):
    w = np.ones(2, np.float32)
    refused(lambda: strata.adam_step(w, np.full(2, 0.5, np.float32), np.zeros(2, np.float32),
                                     np.zeros(2, np.float32), step=step, lr=0.1), "step", beyond(step, INT64))
    assert (w == 1).all()


@pytest.mark.parametrize("step", [1, np.int64(1), np.uint64(1), "torch", 2**63 - 1], ids=repr)
def test_adam_step_accepted(step):
    step = torch_int(1) if isinstance(step, str) else step
    w, m, v = np.ones(2, np.float32), np.zeros(2, np.float32), np.zeros(2, np.float32)
    strata.adam_step(w, np.full(2, 0.5, np.float32), m, v, step=step, lr=0.1)
    # step 1: bias correction makes the update a full lr (1 - 0.1); at a huge step there is none
    # left: 1 - lr * m / sqrt(v), m = 0.1 * 0.5, v = 0.001 * 0.25
    want = 1 - 0.1 * 0.05 / (0.00025 ** 0.5) if isinstance(step, int) and step > 1 else 0.9
    assert w[0] == pytest.approx(want, rel=1e-5)


# -- addresses and streams handed as ints; add_param's element count (uint64_t)

def test_addresses_streams_numel_refused(built):
    g = np.ones(8, np.float32)
    for address in (U64 + g.ctypes.data, g.ctypes.data - U64):
        refused(lambda: built.grads(0, address, dtype="f32"), "grads", address)
    for stream in (U64, U64 + 5, -1, True):
        for call in (lambda: built.fetch(0, stream=stream), lambda: built.release(0, stream=stream),
                     lambda: built.grads(0, g, stream=stream)):
            refused(call, "stream", beyond(stream, UINT64))
    assert built.grad_norm() == 0.0
    with engine() as e:
        for numel in (U64 + 4, -1, True):
            refused(lambda: e.add_param(0, "x", numel), "numel", beyond(numel, UINT64))
        refused(lambda: e.add_param(0, "x", 2**40 + 1), "too many")  # held by a uint64_t: the library's
        assert e.add_param(0, "x", 1) == 0  # the edge: one element
        e.build()
        assert e.group_numel(0) == 1


def test_addresses_streams_accepted(built):
    g = np.ones(8, np.float32)
    built.fetch(0, stream=0)
    built.release(0, stream=0)
    built.grads(0, g.ctypes.data, dtype="f32", stream=0)
    assert built.grad_norm() == pytest.approx(8 ** 0.5)

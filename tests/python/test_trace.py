"""The engine's Chrome trace (strata.trace_path) holds its fetch, stall, grads
and step spans beside the trainer's own (Engine.span), on their tracks,
nested, whenever it is written: mid-run by write_trace() and at close."""
import json
import threading
from decimal import Decimal

import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402

CONFIG = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}


def read_trace(text):
    """The trace's JSON with its times exact. ts and dur are microseconds with
    three decimals (whole nanoseconds); read as floats, ts + dur rounds, and a
    span that ends exactly where its parent ends (both open at a write_trace,
    both cut at it) may seem to end after it: 7206.817 + 4444.926 >
    7205.735 + 4446.008 in floats. Read as Decimal, sums and comparisons are exact."""
    return json.loads(text, parse_float=Decimal)


def spans_of(trace):
    return [ev for ev in trace["traceEvents"] if ev["ph"] == "X"]


def inside(inner, outer):
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]


def assert_nested_per_track(spans):
    """On each (pid, tid) track, complete events nest: no two overlap unless one holds the other."""
    tracks = {}
    for ev in spans:
        assert ev["dur"] >= 0, ev
        tracks.setdefault((ev["pid"], ev["tid"]), []).append(ev)
    for evs in tracks.values():
        evs.sort(key=lambda ev: (ev["ts"], -ev["dur"]))
        stack = []
        for ev in evs:
            while stack and ev["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
                stack.pop()
            if stack:
                assert inside(ev, stack[-1]), (ev, stack[-1])
            stack.append(ev)


def train_traced(e, steps):
    for _ in range(steps):
        with e.span("forward"):
            for g in (0, 1):
                e.fetch(g)
                e.release(g)
        with e.span("backward"):
            for g in (1, 0):
                e.grads(g, torch.ones(e.group_numel(g)))
        e.step()


def test_trace_holds_engine_and_trainer_spans(tmp_path):
    path = tmp_path / "trace.json"
    # P on NVMe: the first step's fetches load their group (P in host memory
    # would be handed out as it is, with nothing to load or stall on).
    cfg = dict(CONFIG, strata={"trace_path": str(path)},
               zero_optimization={"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}})
    with strata.Engine(cfg, force_no_gpu=True) as e:
        e.add_param(0, "a", torch.ones(3000))
        e.add_param(1, "b", torch.ones(5000))
        e.build()
        stop, first_done = threading.Event(), threading.Event()

        def loader():  # another thread's spans, while the main thread drives the engine
            while not stop.is_set():
                with e.span("load batch"):
                    with e.span("decode"):
                        pass
                first_done.set()

        t = threading.Thread(target=loader)
        t.start()
        assert first_done.wait(60), "the loader thread never finished a span"
        with e.span("epoch"):
            with e.span('say "hi" \\ \u2713\n'):  # escaped in the JSON, whole in the trace
                pass
            train_traced(e, 2)
            e.write_trace()  # mid-run, inside the open "epoch" span
            mid = read_trace(path.read_text())
        stop.set()
        t.join()
        train_traced(e, 1)
    final = read_trace(path.read_text())  # written again at close

    spans = spans_of(mid)
    by_name = {}
    for ev in spans:
        by_name.setdefault(ev["name"], []).append(ev)
    assert len(by_name["fetch"]) == 4 and sorted(ev["args"]["group"] for ev in by_name["fetch"]) == [0, 0, 1, 1]
    assert len(by_name["grads"]) == 4 and sorted(ev["args"]["group"] for ev in by_name["grads"]) == [0, 0, 1, 1]
    assert len(by_name["step"]) == 2
    assert len(by_name["forward"]) == 2 and len(by_name["backward"]) == 2
    assert by_name["stall"], "the first step's fetches had to load their group"
    (epoch,) = by_name["epoch"]
    assert epoch["args"].get("unfinished") is True
    # The loader runs on while the trace is written: its "load batch" (or
    # also its "decode") may be open then, written as ending at the write.
    loads, decodes = by_name["load batch"], by_name.get("decode", [])
    assert len(loads) >= 1 and len(decodes) in (len(loads) - 1, len(loads))
    assert sum(ev["args"].get("unfinished", False) for ev in loads) <= 1
    for ev in decodes:
        assert sum(inside(ev, lb) and lb["tid"] == ev["tid"] for lb in loads) == 1
    assert_nested_per_track(spans)
    assert len(by_name['say "hi" \\ \u2713\n']) == 1
    engine_tid = by_name["fetch"][0]["tid"]
    main_tid, loader_tid = by_name["forward"][0]["tid"], by_name["load batch"][0]["tid"]
    assert len({engine_tid, main_tid, loader_tid}) == 3
    names = {ev["tid"]: ev["args"]["name"] for ev in mid["traceEvents"] if ev["ph"] == "M" and ev["name"] == "thread_name"}
    assert names[engine_tid] == "caller" and names[main_tid].startswith("trainer thread")
    for ev in by_name["fetch"]:  # the trainer's forward holds each fetch
        assert ev["tid"] == engine_tid and sum(inside(ev, f) for f in by_name["forward"]) == 1
    for ev in by_name["grads"]:
        assert sum(inside(ev, b) for b in by_name["backward"]) == 1
    for ev in by_name["stall"]:  # each stall lies inside a fetch of its group
        assert any(inside(ev, f) and f["args"]["group"] == ev["args"]["group"] for f in by_name["fetch"])
    for ev in by_name["forward"] + by_name["backward"] + by_name["step"]:
        assert inside(ev, epoch)
    steps = sorted(by_name["step"], key=lambda ev: ev["ts"])
    backs = sorted(by_name["backward"], key=lambda ev: ev["ts"])
    for b, s in zip(backs, steps):  # each step after its backward
        assert b["ts"] + b["dur"] <= s["ts"]

    final_spans = spans_of(final)
    assert_nested_per_track(final_spans)
    assert sum(ev["name"] == "step" for ev in final_spans) == 3
    (epoch,) = [ev for ev in final_spans if ev["name"] == epoch["name"]]
    assert "unfinished" not in epoch["args"]


def test_spans_open_at_a_write_end_together_and_nest_exactly(tmp_path):
    """Spans still open at write_trace are all cut at one time, taken once:
    on each thread each ends exactly where its parent does and nests in it,
    as the trace's times are read exactly (as floats the sums of a deep stack
    would round apart)."""
    path = tmp_path / "trace.json"
    cfg = dict(CONFIG, strata={"trace_path": str(path)})
    depth = 64
    with strata.Engine(cfg, force_no_gpu=True) as e:
        opened, go_on = threading.Event(), threading.Event()

        def other():  # a second thread's stack, open across the write too
            with e.span("other 0"):
                with e.span("other 1"):
                    opened.set()
                    assert go_on.wait(60)

        t = threading.Thread(target=other)
        t.start()
        try:
            assert opened.wait(60), "the other thread never opened its spans"
            spans = [e.span(f"level {k}") for k in range(depth)]
            for s in spans:
                s.__enter__()
            e.write_trace()
            mid = spans_of(read_trace(path.read_text()))
            for s in reversed(spans):
                s.__exit__(None, None, None)
        finally:
            go_on.set()
            t.join()
    assert len(mid) == depth + 2 and all(ev["args"].get("unfinished") is True for ev in mid)
    assert len({ev["ts"] + ev["dur"] for ev in mid}) == 1, "open spans are all cut at the write's one time"
    levels = sorted((ev for ev in mid if ev["name"].startswith("level")), key=lambda ev: int(ev["name"][6:]))
    assert [ev["name"] for ev in levels] == [f"level {k}" for k in range(depth)]
    assert len({ev["tid"] for ev in levels}) == 1 and levels[0]["tid"] != next(
        ev["tid"] for ev in mid if ev["name"] == "other 0")
    for outer, inner in zip(levels, levels[1:]):
        assert outer["ts"] < inner["ts"] and inside(inner, outer), (inner, outer)
    assert_nested_per_track(mid)
    final = spans_of(read_trace(path.read_text()))  # at close: all ended, none unfinished, nested
    assert len(final) == depth + 2 and not any("unfinished" in ev["args"] for ev in final)
    assert_nested_per_track(final)


def test_trace_calls_refuse_what_they_cannot_do(tmp_path):
    with strata.Engine(CONFIG, force_no_gpu=True) as e:
        with e.span("untraced"):  # no trace path: checked, not recorded
            pass
        with pytest.raises(strata.Error) as err:
            e.write_trace()
        assert err.value.status == strata.CONFIG and "trace_path" in err.value.message
        with pytest.raises(strata.Error) as err:
            with e.span(""):
                pass
        assert err.value.status == strata.INVALID and "span name" in err.value.message

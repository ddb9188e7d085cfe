"""The engine's Chrome trace (strata.trace_path) holds its fetch, stall, grads
and step spans beside the trainer's own (Engine.span), on their tracks,
nested, whenever it is written: mid-run by write_trace() and at close."""
import json
import threading

import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402

CONFIG = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}


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
    cfg = dict(CONFIG, strata={"trace_path": str(path)},
               zero_optimization={"stage": 3, "offload_param": {"device": "cpu"}})
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
            mid = json.loads(path.read_text())
        stop.set()
        t.join()
        train_traced(e, 1)
    final = json.loads(path.read_text())  # written again at close

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

"""strata.torch's reading of the config (_config.py): "auto" and null mean the
section's or the key's default everywhere (docs/config.md), as the engine
reads them, never an AttributeError; offload_module refuses a null learning
rate as it refuses "auto"; a config that is not a JSON object is refused
with strata.Error. And the swap folders of engines that were killed
(SIGKILL, the OOM killer, scancel) are removed by the next engine made
under the same nvme_path, never a live engine's nor anything else."""
import copy
import fcntl
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

import strata  # noqa: E402
import strata.torch as st  # noqa: E402
from strata.torch import _config  # noqa: E402

LR = {"type": "AdamW", "params": {"lr": 1e-2}}


def nvme(path):
    return {"device": "nvme", "nvme_path": str(path)}


def train(model, opt, steps=2):
    for _ in range(steps):
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()


def left_in(folder):
    return sorted(os.path.relpath(os.path.join(r, n), folder) for r, ds, fs in os.walk(folder) for n in ds + fs)


# ---- A. "auto" and null sections and keys ----------------------------------------

ADAM_CONFIGS = {
    "offload_param auto": {"zero_optimization": {"stage": 1, "offload_param": "auto"}},
    "offload_optimizer null": {"zero_optimization": {"stage": 1, "offload_optimizer": None}},
    "zero_optimization auto": {"zero_optimization": "auto"},
    "zero_optimization null": {"zero_optimization": None},
    "strata null": {"strata": None},
    "strata auto": {"strata": "auto"},
    "nvme_paths auto": {"strata": {"nvme_paths": "auto"}},
    "nvme_path auto": {"zero_optimization": {"stage": 1, "offload_optimizer": {"nvme_path": "auto"}}},
}


@pytest.mark.parametrize("name", list(ADAM_CONFIGS))
def test_offload_adam_reads_auto_and_null_as_the_default(name, tmp_path, monkeypatch):
    """OffloadAdam trains under a config whose sections (or nvme paths) are
    "auto" or null, as the engine reads them: the defaults. The user's dict
    is left as it was, and no folder is made from the letters of "auto".
    Before, _swap_folders called .get on them: AttributeError (nvme_paths
    "auto": INVALID, "nvme_path 'a' does not exist")."""
    monkeypatch.chdir(tmp_path)
    cfg = ADAM_CONFIGS[name]
    given = copy.deepcopy(cfg)
    model = nn.Linear(8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the "auto" keys the engine filled are said)
        opt = st.OffloadAdam(model.parameters(), lr=1e-2, config=cfg, force_no_gpu=True)
    try:
        train(model, opt)
    finally:
        opt.close()
    assert cfg == given, "the user's config was changed"
    assert left_in(tmp_path) == []


def test_offload_adam_state_format_under_a_null_strata_section():
    """state_format= with a null or "auto" strata section, or a null or
    "auto" strata.state_format: the argument's format. Before: AttributeError
    on the section, ValueError on the key."""
    for cfg in ({"strata": None}, {"strata": "auto"}, {"strata": {"state_format": None}},
                {"strata": {"state_format": "auto"}}):
        given = copy.deepcopy(cfg)
        model = nn.Linear(8, 8)
        opt = st.OffloadAdam(model.parameters(), config=cfg, force_no_gpu=True, state_format="fp32")
        try:
            train(model, opt, 1)
        finally:
            opt.close()
        assert cfg == given


MODULE_CONFIGS = {
    "offload_param auto": {"zero_optimization": {"stage": 3, "offload_param": "auto"}},
    "offload_optimizer null": {"zero_optimization": {"stage": 3, "offload_optimizer": None}},
    "zero_optimization auto": {"zero_optimization": "auto"},
    "strata null": {"strata": None},
    "strata auto": {"strata": "auto"},
    "nvme_paths null": {"strata": {"nvme_paths": None}},
}


@pytest.mark.parametrize("name", list(MODULE_CONFIGS))
def test_offload_module_reads_auto_and_null_as_the_default(name, tmp_path, monkeypatch):
    """offload_module, likewise, with and without state_format= (which
    writes into the strata section): it trains and leaves the user's dict
    as it was. Before: AttributeError."""
    monkeypatch.chdir(tmp_path)
    for state_format in (None, "fp32"):
        cfg = dict(copy.deepcopy(MODULE_CONFIGS[name]), optimizer=copy.deepcopy(LR))
        given = copy.deepcopy(cfg)
        model = nn.Linear(8, 8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            off = st.offload_module(model, cfg, force_no_gpu=True, state_format=state_format)
        try:
            train(model, off.optimizer)
        finally:
            off.close()
        assert cfg == given, "the user's config was changed"
    assert left_in(tmp_path) == []


def test_torch_first_moment_under_auto_and_null_keys():
    """The first moment as this torch computes it where the optimizer's
    type, params or moment_update are "auto" or null (the defaults: AdamW,
    the engine's moment). Before: type "auto" was not Adam (no moment set),
    a null params section raised AttributeError, a null moment_update
    stayed null (the engine's own, not this torch's)."""
    for opt in ({"type": "auto"}, {"type": None, "params": {"moment_update": "auto"}},
                {"params": None}, {"params": "auto"}, {"params": {"moment_update": None}}):
        cfg = _config._with_torch_moment({"optimizer": copy.deepcopy(opt)})
        assert cfg["optimizer"]["params"]["moment_update"] == _config._MOMENT_UPDATE, opt
    for opt in (None, "auto"):
        cfg = _config._with_torch_moment({"optimizer": opt})
        assert cfg["optimizer"]["params"]["moment_update"] == _config._MOMENT_UPDATE, opt
    said = {"optimizer": {"type": "lion", "params": {"moment_update": None}}}
    assert _config._with_torch_moment(copy.deepcopy(said)) == said  # not Adam: left to the engine


@pytest.mark.parametrize("lr_at", ["lr", "params", "optimizer"])
def test_offload_module_refuses_a_null_learning_rate_as_auto(lr_at):
    """offload_module takes the learning rate from the config alone: a null
    lr (or a null params or optimizer section) would train at the engine's
    default 1e-3, as "auto" would (refused: test_hf_findings.py): it is
    refused, naming the key. Before, null trained silently at 1e-3 (params
    null: AttributeError)."""
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": None, "weight_decay": 0.0}}}
    if lr_at == "params":
        cfg["optimizer"]["params"] = None
    elif lr_at == "optimizer":
        cfg["optimizer"] = None
    key = {"lr": "optimizer.params.lr", "params": "optimizer.params", "optimizer": "optimizer"}[lr_at]
    with pytest.raises(strata.Error, match=rf"INVALID: offload_module: the config's {key} is null, and nothing "
                                           "fills"):
        st.offload_module(nn.Linear(8, 8), cfg, force_no_gpu=True)


@pytest.mark.parametrize("text", ["[1]", "null", '"auto"', "{bad"])
def test_a_config_that_is_not_a_json_object_is_a_config_error(text):
    """A config string that is not JSON, or not an object: strata.Error
    CONFIG, as the engine says it. Before: AttributeError or
    json.JSONDecodeError."""
    for make in (lambda: st.offload_module(nn.Linear(8, 8), text, force_no_gpu=True),
                 lambda: st.OffloadAdam(nn.Linear(8, 8).parameters(), config=text, force_no_gpu=True)):
        with pytest.raises(strata.Error, match="CONFIG: .*(JSON object|invalid JSON)"):
            make()


# ---- B. a killed engine's swap folder ---------------------------------------------

WORKER = textwrap.dedent("""
    import os, sys, torch, torch.nn as nn, strata.torch as st
    kind, path = sys.argv[1], sys.argv[2]
    sec = {"device": "nvme", "nvme_path": path}
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    if kind == "adam":
        opt = st.OffloadAdam(model.parameters(), lr=1e-2, force_no_gpu=True,
                             config={"zero_optimization": {"stage": 1, "offload_optimizer": sec}})
        folders = [f for ge in opt._engines for f in ge.folders]
    else:
        off = st.offload_module(model, {"zero_optimization": {"stage": 3, "offload_optimizer": sec,
                                                              "offload_param": dict(sec)},
                                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}},
                                force_no_gpu=True)
        opt, folders = off.optimizer, off._folders
    def step():
        model(torch.randn(2, 64)).sum().backward(); opt.step(); opt.zero_grad()
    step()
    print("ready", *folders, flush=True)
    if sys.stdin.readline().strip() == "step":
        step()
        print("stepped", flush=True)
""")


def start_worker(kind, path):
    return subprocess.Popen([sys.executable, "-c", WORKER, kind, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))


def ready(proc, timeout=90):
    """The worker's swap folders, once it has stepped (its swap files made)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 1)[0]:
            line = proc.stdout.readline()
            if line.startswith("ready "):
                return line.split()[1:]
            if not line:
                break
    proc.kill()
    raise AssertionError(f"worker not ready: {proc.communicate()[1][-2000:]}")


def swap_files(folder):
    return [n for n in os.listdir(folder) if n.startswith("strata-swap.") and n.endswith(".bin")]


def test_a_killed_engines_swap_folder_goes_a_live_ones_stays(tmp_path):
    """Two engines killed with SIGKILL (an OffloadAdam's and an
    offload_module's: their swap files, fallocated, stay on disk) and one
    alive in another process, all under one nvme_path: the next engine made
    there removes the killed ones' folders, saying so once with their bytes,
    and leaves the live one's, which still steps. Before, the killed ones'
    folders stayed for good (the engine sweeps only its own folder)."""
    procs = {kind: start_worker(kind.split("-")[0], tmp_path)
             for kind in ("adam-killed", "module-killed", "module-live")}
    try:
        folders = {kind: ready(p) for kind, p in procs.items()}
        for kind in ("adam-killed", "module-killed"):
            assert all(swap_files(f) for f in folders[kind]), folders[kind]
            procs[kind].send_signal(signal.SIGKILL)
            procs[kind].wait(30)
        dead = folders["adam-killed"] + folders["module-killed"]
        assert all(os.path.isdir(f) and swap_files(f) for f in dead), "the kill removed the folders"
        bytes_left = sum(os.path.getsize(os.path.join(f, n)) for f in dead for n in swap_files(f))

        model = nn.Linear(8, 8)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            opt = st.OffloadAdam(model.parameters(), lr=1e-2, force_no_gpu=True,
                                 config={"zero_optimization": {"stage": 1, "offload_optimizer": nvme(tmp_path)}})
        try:
            train(model, opt, 1)
            assert [f for f in dead if os.path.exists(f)] == [], "a killed engine's swap folder was left"
            live = folders["module-live"]
            assert all(os.path.isdir(f) and swap_files(f) for f in live), "a live engine's folder was removed"
            sweeps = [str(w.message) for w in said if "removed" in str(w.message)]
            assert len(sweeps) == 1, [str(w.message) for w in said]
            assert all(os.path.basename(f) in sweeps[0] for f in dead) and f"{bytes_left} bytes" in sweeps[0]
            assert "\n" not in sweeps[0]
        finally:
            opt.close()
        out, err = procs["module-live"].communicate("step\n", timeout=60)
        assert procs["module-live"].returncode == 0 and "stepped" in out, err[-2000:]
        assert left_in(tmp_path) == []
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def gone_pid():
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_the_sweep_removes_only_what_the_scheme_names_and_nobody_holds(tmp_path, monkeypatch):
    """Beside the engine's own folder, the sweep removes a folder named
    strata-<key>-<pid>-<id> (offload_module's) or
    strata-<key>-<pid>-<id>-<group>-<n> (OffloadAdam's), <key> this host's,
    whose creating process is gone and that holds only
    unlocked swap files, or nothing and is an hour old. It keeps: a folder
    whose swap file someone holds the flock of (a live engine of another
    pid namespace or host), an empty one made recently (an engine about to
    make its files), one whose creator lives, names outside the scheme, a
    folder holding anything but swap files, a symlink, a file. Before,
    nothing was removed."""
    monkeypatch.setattr(_config, "_LOCK_GRACE_S", 0.2)  # (the held flock below is waited for that long)
    dead, live = gone_pid(), os.getppid()
    k = _config._host_key()
    old = time.time() - 7200

    def folder(name, *files, age=None):
        f = tmp_path / name
        f.mkdir()
        for n in files:
            (f / n).write_bytes(b"x" * 4096)
        if age is not None:
            os.utime(f, (age, age))
        return f

    goes = [folder(f"strata-{k}-{dead}-140000000000", "strata-swap.r0.s0.bin", "strata-swap.r0.s1.g2.bin"),
            folder(f"strata-{k}-{dead}-140000000001-0-3", "strata-swap.r3.s0.bin"),
            folder(f"strata-{k}-{dead}-140000000002", age=old)]
    held = folder(f"strata-{k}-{dead}-140000000003", "strata-swap.r0.s0.bin")
    stays = [held,
             folder(f"strata-{k}-{dead}-140000000004"),  # empty, recent
             folder(f"strata-{k}-{live}-140000000005", "strata-swap.r0.s0.bin"),  # its creator lives
             folder(f"strata-{k}-{dead}-140000000006", "strata-swap.r0.s0.bin", "notes.txt"),
             folder(f"strata-{k}-{dead}-1400x", "strata-swap.r0.s0.bin", age=old),
             folder(f"strata-{k}-{dead}-14-0", "strata-swap.r0.s0.bin", age=old),
             folder(f"strata-{k}-{dead}-1-2-3-4", "strata-swap.r0.s0.bin", age=old),
             folder(f"strata-{k}-{dead}-1-", age=old),
             folder(f"xstrata-{k}-{dead}-1", age=old),
             folder(f"strata-{k}-{dead}-2", "strata-swap.r0.s0.bin.tmp", age=old),
             folder(f"strata-{k}-{dead}-3", "strata-swap.rx.s0.bin", age=old)]
    (tmp_path / f"strata-{k}-{dead}-7").write_bytes(b"x")  # a file
    os.symlink(goes[0], tmp_path / f"strata-{k}-{dead}-8")  # a link (to a folder that goes)
    elsewhere = folder("elsewhere", "strata-swap.r0.s0.bin", age=old)
    os.symlink(elsewhere, tmp_path / f"strata-{k}-{dead}-9")  # a link (to a folder that stays)
    kept = {*stays, *(tmp_path / f"strata-{k}-{dead}-{n}" for n in (7, 8, 9)), elsewhere}

    fd = os.open(held / "strata-swap.r0.s0.bin", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            made = _config._separate_swap_folders({"strata": {"nvme_paths": [str(tmp_path)]}},
                                                  _config._engine_tag(1, 0, 0))
        mine = made["strata"]["nvme_paths"][0]
        assert os.path.isdir(mine)
        assert [str(f) for f in goes if os.path.lexists(f)] == []
        assert sorted(str(f) for f in kept if not os.path.lexists(f)) == []
        assert os.listdir(held) == ["strata-swap.r0.s0.bin"] and os.listdir(elsewhere) == ["strata-swap.r0.s0.bin"]
        sweeps = [str(w.message) for w in said]
        assert len(sweeps) == 1 and f"{3 * 4096} bytes" in sweeps[0], sweeps
        _config._remove_swap_folders([mine])
    finally:
        os.close(fd)

    # A tag outside the scheme sweeps nothing.
    (tmp_path / f"strata-{k}-{dead}-10").mkdir()
    os.utime(tmp_path / f"strata-{k}-{dead}-10", (old, old))
    _config._remove_swap_folders([_config._subfolder(str(tmp_path), "mine")])
    assert os.path.isdir(tmp_path / f"strata-{k}-{dead}-10")


def test_the_sweep_keeps_the_folders_of_another_host_or_pid_namespace(tmp_path):
    """On a file system several hosts share (BeeGFS, Lustre with
    localflock, NFS with local_lock=flock) flock is the host's own and a pid
    of another host looks gone here: the sweep removes only folders whose
    name carries this host's key (boot id and pid namespace), never one with
    another key or none (made before keys; or by another host). Before, a
    dead pid and free flocks were enough: another host's live engine lost
    its swap files."""
    dead, k = gone_pid(), _config._host_key()
    other = "0123456789ab" if k != "0123456789ab" else "ba9876543210"
    old = time.time() - 7200

    def folder(name):
        f = tmp_path / name
        f.mkdir()
        (f / "strata-swap.r0.s0.bin").write_bytes(b"x" * 4096)
        os.utime(f, (old, old))
        return f

    ours = [folder(f"strata-{k}-{dead}-140000000000"), folder(f"strata-{k}-{dead}-140000000001-0-3")]
    kept = [folder(f"strata-{other}-{dead}-140000000002"), folder(f"strata-{other}-{dead}-140000000003-1-2"),
            folder(f"strata-{dead}-140000000004"), folder(f"strata-{dead}-140000000005-0-3"),  # keyless
            folder(f"strata-{k[:-1]}-{dead}-140000000006"), folder(f"strata-{k}0-{dead}-140000000007")]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        made = _config._separate_swap_folders({"strata": {"nvme_paths": [str(tmp_path)]}}, _config._engine_tag(1))
    assert [str(f) for f in ours if os.path.lexists(f)] == []
    assert [str(f) for f in kept if not os.path.isdir(f)] == []
    sweeps = [str(w.message) for w in said]
    assert len(sweeps) == 1 and f"{2 * 4096} bytes" in sweeps[0], sweeps
    assert all(f.name in sweeps[0] for f in ours) and not any(f.name in sweeps[0] for f in kept), sweeps
    _config._remove_swap_folders(made["strata"]["nvme_paths"])


def test_engine_folders_are_named_with_this_hosts_key(tmp_path):
    """OffloadAdam's and offload_module's swap folders are named
    strata-<key>-<pid>-<id>[-<group>-<n>], the key this host's (short hex,
    the same in another process here), so that the sweep knows its own."""
    k = _config._host_key()
    assert len(k) == 12 and all(c in "0123456789abcdef" for c in k)
    other = subprocess.run([sys.executable, "-c", "from strata.torch import _config; print(_config._host_key())"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert other == k
    model = nn.Linear(8, 8)
    opt = st.OffloadAdam(model.parameters(), lr=1e-2, force_no_gpu=True,
                         config={"zero_optimization": {"stage": 1, "offload_optimizer": nvme(tmp_path)}})
    off = st.offload_module(nn.Linear(8, 8), {"zero_optimization": {"stage": 3, "offload_param": nvme(tmp_path)},
                                              "optimizer": LR}, force_no_gpu=True)
    try:
        names = sorted(os.listdir(tmp_path))
        assert len(names) == 2, names
        assert all(_config._ENGINE_FOLDER.match(n) and n.startswith(f"strata-{k}-{os.getpid()}-") for n in names)
        assert sorted(n.count("-") for n in names) == [3, 5], names
    finally:
        opt.close()
        off.close()


def test_engine_swap_folders_are_the_users_own(tmp_path):
    """The engine's swap subfolder is made mode 0700 (under umask 022 it was
    0755: any local user could list it); the user's nvme_path keeps its
    mode."""
    os.chmod(tmp_path, 0o755)
    mask = os.umask(0o022)
    try:
        model = nn.Linear(8, 8)
        opt = st.OffloadAdam(model.parameters(), lr=1e-2, force_no_gpu=True,
                             config={"zero_optimization": {"stage": 1, "offload_optimizer": nvme(tmp_path)}})
        off = st.offload_module(nn.Linear(8, 8), {"zero_optimization": {"stage": 3, "offload_param": nvme(tmp_path)},
                                                  "optimizer": LR}, force_no_gpu=True)
        made = _config._separate_swap_folders({"strata": {"nvme_paths": [str(tmp_path)]}}, "mine")
    finally:
        os.umask(mask)
    try:
        train(model, opt, 1)
        folders = [tmp_path / n for n in os.listdir(tmp_path)]
        assert len(folders) == 3
        assert {oct(os.stat(f).st_mode & 0o777) for f in folders} == {oct(0o700)}
        assert os.stat(tmp_path).st_mode & 0o777 == 0o755
    finally:
        opt.close()
        off.close()
        _config._remove_swap_folders(made["strata"]["nvme_paths"])


# ---- "auto" is exactly "auto", as the engine reads it ------------------------------

@pytest.mark.parametrize("value", ["Auto", "AUTO"])
def test_auto_is_exactly_auto_as_the_engine_reads_it(value, tmp_path):
    """The engine takes only "auto" (and null) as the default: "Auto" is no
    default in strata.torch either (before: the section replaced with {} and
    accepted here while the engine refuses it; an nvme_path "AUTO" taken
    as absent)."""
    assert not _config._absent(value) and _config._absent("auto") and _config._absent(None)
    assert _config._a_path(value)
    with pytest.raises(strata.Error):
        st.OffloadAdam(nn.Linear(4, 4).parameters(), lr=0.1, force_no_gpu=True, config={"strata": value})
    with pytest.raises(strata.Error) as err:
        st.OffloadAdam(nn.Linear(4, 4).parameters(), lr=0.1, force_no_gpu=True,
                       config={"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme",
                                                                                      "nvme_path": value}}})
    assert value in str(err.value), err.value


@pytest.mark.parametrize("value", ["auto", None])
def test_offload_adam_moment_update_auto_is_torchs(value, monkeypatch):
    """OffloadAdam's moment_update "auto" or null is this torch's first
    moment, as when it is absent and as offload_module's (before: left in
    place, the engine's mul_add under torch 2's lerp). Made "lerp" here, so
    that the check bites under either torch."""
    import strata.torch._offload_adam as offload_adam
    monkeypatch.setattr(offload_adam, "_MOMENT_UPDATE", "lerp")
    opt = st.OffloadAdam(nn.Linear(4, 4).parameters(), lr=0.1, force_no_gpu=True,
                         config={"optimizer": {"params": {"moment_update": value}}})
    assert opt._engines[0].engine.config["optimizer"]["params"]["moment_update"] == "lerp"
    opt.close()


@pytest.mark.parametrize("planted", ["symlink", "group_writable"])
def test_an_existing_engine_folder_must_be_the_users_own(planted, tmp_path):
    """The engine's folder name already there: taken only where it is a real
    folder of this user, mode 0700 (os.lstat); a symbolic link to another
    folder, or a folder others may use, is refused naming it (before:
    os.path.isdir followed the link and took it)."""
    tag = _config._engine_tag(12345)
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    (tmp_path / "swap").mkdir()
    sub = tmp_path / "swap" / tag
    if planted == "symlink":
        os.symlink(other, sub)
    else:
        sub.mkdir()
        os.chmod(sub, 0o770)
    with pytest.raises(strata.Error) as err:
        _config._subfolder(str(tmp_path / "swap"), tag)
    assert err.value.status == strata.INVALID and str(sub) in str(err.value), err.value
    os.chmod(other, 0o700)
    ok = tmp_path / "swap2"
    ok.mkdir()
    (ok / tag).mkdir(mode=0o700)
    assert _config._subfolder(str(ok), tag) == str(ok / tag)

"""strata.torch._sizing: OffloadAdam's engine groups cut to the model and the host
budget (split_buckets, auto_bucket_numel) and the engine's copy of the
parameters homed on NVMe where it would be a second one in host memory
(lean_host_config)."""
import pytest

from strata.torch import _sizing as sz


def nvme(**extra):
    cfg = {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": "/swap"}}}
    cfg.update(extra)
    return cfg


@pytest.mark.parametrize("numels,bucket", [([5, 3, 10, 0, 2], 4), ([1] * 9, 3), ([100], 7), ([7, 7], 7),
                                           ([0, 4, 0], 4), ([3, 0], 3), ([], 5), ([2, 9, 1, 30, 4], 8)])
def test_split_buckets_cover_every_tensor_in_order_in_full_buckets(numels, bucket):
    buckets = sz.split_buckets(numels, bucket)
    seen = {i: 0 for i in range(len(numels))}  # the next element each tensor must continue from
    order = []
    for b in buckets:
        assert sum(c for _, _, c in b) <= bucket
        for i, start, count in b:
            assert start == seen[i], (i, start, seen[i])
            seen[i] += count
            order.append(i)
    assert [seen[i] for i in range(len(numels))] == list(numels)
    assert order == sorted(order), "tensors keep their order"
    assert set(order) == set(range(len(numels))), "every tensor has an entry, empty ones too"
    for b in buckets[:-1]:
        assert sum(c for _, _, c in b) == bucket, "only the last bucket may be partly filled"
    assert all(any(c for _, _, c in b) for b in buckets) or sum(numels) == 0, "no bucket of empty tensors alone"


def test_split_buckets_refuses_bad_sizes():
    with pytest.raises(ValueError, match="bucket_numel 0"):
        sz.split_buckets([4], 0)
    with pytest.raises(ValueError, match="tensor 1 has -2"):
        sz.split_buckets([4, -2], 4)


def test_auto_bucket_keeps_the_default_when_nothing_is_staged():
    for cfg in ({}, {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}):
        assert sz.auto_bucket_numel(300_000_000, cfg, host_ram_bytes=1 << 35) == sz.DEFAULT_BUCKET_NUMEL


def test_auto_bucket_follows_the_model_within_bounds():
    ram = 24 << 30
    sizes = [10**4, 10**6, 11_689_512, 10**8, 302_000_000, 10**10]
    buckets = [sz.auto_bucket_numel(n, nvme(), host_ram_bytes=ram) for n in sizes]
    assert buckets == sorted(buckets), "a larger model never gets smaller groups"
    assert all(b & (b - 1) == 0 for b in buckets), "powers of two"
    assert buckets[0] == sz.MIN_BUCKET_NUMEL and buckets[-1] == sz.DEFAULT_BUCKET_NUMEL
    assert buckets[2] == 1 << 17 and buckets[4] == 1 << 22  # resnet18, a 300M model
    # The staging stays a small share of the model (torch AdamW adds 8 bytes a parameter).
    per = sz._staged_bytes_per_element(nvme())
    for n, b in zip(sizes, buckets):
        if b > sz.MIN_BUCKET_NUMEL:
            assert per * b <= sz.STAGING_SHARE * 4 * n


def test_auto_bucket_follows_the_host_budget_and_the_slots():
    big = 10**10
    roomy = sz.auto_bucket_numel(big, nvme(), host_ram_bytes=1 << 40)
    tight = sz.auto_bucket_numel(big, nvme(strata={"host_budget": 1 << 30}), host_ram_bytes=1 << 40)
    assert tight < roomy and sz._staged_bytes_per_element(nvme()) * tight <= sz.BUDGET_SHARE * (1 << 30)
    assert sz.auto_bucket_numel(big, nvme(), host_ram_bytes=1 << 30) < roomy  # "auto": half of RAM
    many = nvme()
    many["zero_optimization"]["offload_optimizer"]["buffer_count"] = 16
    assert sz._staged_bytes_per_element(many) > sz._staged_bytes_per_element(nvme())
    assert sz.auto_bucket_numel(10**8, many, host_ram_bytes=1 << 40) < sz.auto_bucket_numel(
        10**8, nvme(), host_ram_bytes=1 << 40)
    with pytest.raises(ValueError, match="negative"):
        sz.auto_bucket_numel(-1, nvme())


def test_lean_host_config_homes_p_on_nvme_only_where_it_is_a_second_host_copy():
    cfg = nvme()
    lean = sz.lean_host_config(cfg, 1 << 17, on_gpu=False, world_size=1)
    assert cfg == nvme(), "the caller's config is not changed"
    z = lean["zero_optimization"]
    assert z["offload_param"] == {"device": "nvme", "nvme_path": "/swap"} and z["stage"] == 3
    assert lean["strata"]["device_budget"] == sz.P_COPIES * (1 << 17) * 4 + (1 << 20)
    assert lean["zero_optimization"]["offload_optimizer"] == cfg["zero_optimization"]["offload_optimizer"]
    bf16 = sz.lean_host_config(nvme(bf16={"enabled": True}), 1 << 17, on_gpu=False, world_size=1)
    assert bf16["strata"]["device_budget"] == sz.P_COPIES * (1 << 17) * 2 + (1 << 20)
    placed = nvme()
    placed["zero_optimization"]["offload_param"] = {"device": "cpu"}
    for kept, kw in ((nvme(), {"on_gpu": True, "world_size": 1}),  # P is on the GPU
                     (nvme(), {"on_gpu": False, "world_size": 2}),  # below stage 3 every rank keeps all of P
                     (placed, {"on_gpu": False, "world_size": 1}),  # the caller placed P
                     (nvme(strata={"device_budget": 1 << 30}), {"on_gpu": False, "world_size": 1}),
                     ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
                      {"on_gpu": False, "world_size": 1})):
        assert sz.lean_host_config(kept, 1 << 17, **kw) is kept


def test_auto_bucket_shares_the_auto_budget_among_the_ranks_on_the_host(monkeypatch):
    big = 10**10
    ram = 1 << 31
    one = sz.auto_bucket_numel(big, nvme(), host_ram_bytes=ram, ranks_on_host=1)
    four = sz.auto_bucket_numel(big, nvme(), host_ram_bytes=ram, ranks_on_host=4)
    assert four < one and four == sz.auto_bucket_numel(big, nvme(), host_ram_bytes=ram // 4, ranks_on_host=1)
    # A budget in bytes is each rank's own: the ranks do not divide it.
    given = nvme(strata={"host_budget": 1 << 30})
    assert sz.auto_bucket_numel(big, given, host_ram_bytes=ram, ranks_on_host=4) == \
        sz.auto_bucket_numel(big, given, host_ram_bytes=ram, ranks_on_host=1)
    with pytest.raises(ValueError, match="ranks_on_host 0"):
        sz.auto_bucket_numel(big, nvme(), host_ram_bytes=ram, ranks_on_host=0)
    # Unsaid, the ranks are the launcher's on this host (strata_host_memory).
    for k, v in {"RANK": "1", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(k, v)
    import strata
    assert strata.host_memory()[1] == 4
    assert sz.auto_bucket_numel(big, nvme(), host_ram_bytes=ram) == four


def test_host_memory_is_the_engines(monkeypatch):
    import os
    import strata
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
              "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    ram, ranks = strata.host_memory()
    assert 0 < ram <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") and ranks == 1
    assert sz._host_memory() == (ram, 1)
    # The auto budget the bucket is sized by is the engine's host.budget.
    e = strata.Engine({"zero_optimization": {"stage": 1}}, force_no_gpu=True)
    try:
        e.add_param(0, "w", 1024)
        e.build()
        assert e.stats()["host"]["budget"] == ram // 2
    finally:
        e.close()


def _memory_cgroup(name, limit):
    """A memory cgroup of `limit` bytes (v1, or v2 with the memory controller
    delegated), as (its cgroup.procs, its directory); None where this
    process may not make one."""
    import os
    for root, knob in (("/sys/fs/cgroup/memory", "memory.limit_in_bytes"), ("/sys/fs/cgroup", "memory.max")):
        if not os.path.isdir(root) or not os.access(root, os.W_OK):
            continue
        if knob == "memory.max":
            try:
                with open(os.path.join(root, "cgroup.subtree_control")) as f:
                    if "memory" not in f.read().split():
                        continue
            except OSError:
                continue
        path = os.path.join(root, name)
        try:
            os.mkdir(path)
        except OSError:
            continue
        try:
            with open(os.path.join(path, knob), "w") as f:
                f.write(str(limit))
            return os.path.join(path, "cgroup.procs"), path
        except OSError:
            os.rmdir(path)
    return None


def test_a_cgroup_memory_limit_caps_the_auto_budget_and_the_buckets():
    """A real cgroup (root, v1 or delegated v2): a process inside it is given
    its limit by strata_host_memory, and OffloadAdam's auto bucket follows."""
    import os
    import subprocess
    import sys
    limit = 3 << 30
    made = _memory_cgroup(f"strata-sizing-test-{os.getpid()}", limit)
    if made is None:
        pytest.skip("cannot make a memory cgroup here (needs root and a writable cgroup v1 memory hierarchy, "
                    "or cgroup v2 with the memory controller delegated)")
    procs, path = made
    code = ("import os, sys, strata\n"
            "from strata.torch import _sizing as sz\n"
            "cfg = {'zero_optimization': {'stage': 1, 'offload_optimizer': {'device': 'nvme', 'nvme_path': '/swap'}}}\n"
            "print(strata.host_memory()[0], sz.auto_bucket_numel(10**10, cfg))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}

    def enter():
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, preexec_fn=enter, capture_output=True,
                             text=True, timeout=120)
    finally:
        for _ in range(50):  # the child has left; its cgroup empties as it is reaped
            try:
                os.rmdir(path)
                break
            except OSError:
                import time
                time.sleep(0.1)
    assert out.returncode == 0, out.stderr
    seen, bucket = (int(x) for x in out.stdout.split())
    assert seen == limit
    cfg = nvme()
    assert bucket == sz.auto_bucket_numel(10**10, cfg, host_ram_bytes=limit, ranks_on_host=1)
    assert bucket < sz.auto_bucket_numel(10**10, cfg, host_ram_bytes=os.sysconf("SC_PHYS_PAGES") *
                                          os.sysconf("SC_PAGE_SIZE"), ranks_on_host=1)

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

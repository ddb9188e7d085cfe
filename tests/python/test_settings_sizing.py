"""strata.torch._sizing reads the config as the engine reads it (the engine
itself is the oracle here): DeepSpeed's deprecated cpu_offload_param places
P, so lean_host_config leaves it alone; strata.host_budget as a size string
("1GiB") is that many bytes, and what the engine refuses is refused, naming
it; bf16/fp16 "enabled": "auto" is false (as any "auto" the engine reads is
absent), and "bfloat16" is bf16's other spelling; choices are read
case-insensitively."""
import pytest

import strata
from strata.torch import _sizing as sz


def nvme(path="/swap", **extra):
    cfg = {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": str(path)}}}
    cfg.update(extra)
    return cfg


def engine_config(cfg):
    """The config as the engine resolved it, or the engine's CONFIG error."""
    try:
        e = strata.Engine(cfg, force_no_gpu=True)
    except strata.Error as err:
        assert err.status == strata.CONFIG, str(err)
        return err
    try:
        return e.config
    finally:
        e.close()


def test_lean_host_config_leaves_p_where_cpu_offload_param_put_it(tmp_path):
    cfg = nvme(tmp_path)
    cfg["zero_optimization"]["cpu_offload_param"] = True
    lean = sz.lean_host_config(cfg, 1 << 17, on_gpu=False, world_size=1)
    assert engine_config(lean)["zero_optimization"]["offload_param"]["device"] == "cpu", "P was moved to NVMe"
    assert lean is cfg


@pytest.mark.parametrize("key,value", [("offload_param", "auto"), ("offload_param", None),
                                       ("cpu_offload_param", "auto"), ("device_budget", "auto")])
def test_lean_host_config_reads_auto_as_unsaid_as_the_engine_does(tmp_path, key, value):
    cfg = nvme(tmp_path, strata={})
    (cfg["strata"] if key == "device_budget" else cfg["zero_optimization"])[key] = value
    assert engine_config(cfg)["zero_optimization"]["offload_param"]["device"] == "none"  # the default: unsaid
    lean = sz.lean_host_config(cfg, 1 << 17, on_gpu=False, world_size=1)
    assert lean["zero_optimization"]["offload_param"]["device"] == "nvme"
    assert lean["strata"]["device_budget"] == sz.P_COPIES * (1 << 17) * 4 + (1 << 20)
    assert engine_config(lean)["zero_optimization"]["offload_param"]["device"] == "nvme"


@pytest.mark.parametrize("given", ["1GiB", "1.5 GiB", "8e9", "512mib", "4 k b", ".5K", "1.e3", "4.1GB", "2TB",
                                   "9007199254740993", "1e-3MB", "0.5KiB", "9223372036854775807", "8E+9",
                                   "9.094947017729282379150390625e-13TiB", "0.0009765625KiB", "8.2TB",
                                   1 << 30, 8e9, 3.0, "auto", None])
def test_a_host_budget_the_engine_takes_is_the_same_bytes(given):
    cfg = {"strata": {"host_budget": given}}
    engine = engine_config(cfg)["strata"]["host_budget"]
    assert sz._host_budget(cfg) == (None if engine == "auto" else engine)


@pytest.mark.parametrize("given", ["0", 0, "abc", "-1", "0.5", "12XB", "1e30", "nan", "inf", "1e", "", "0x", True,
                                   "+64MiB", "0x10", "1e-7MB", "9223372036854775808", "1e+", ".", "1..5", "1e999999",
                                   "00", {"a": 1}, -5, 1.5, float("nan"), 1 << 63, "9.3e18", [1], "1" * 65,
                                   "1\u212a", "\u0661", "1.0000000000000000001", "0.0009765626KiB",
                                   "123456789012345678901234567890123456789012345",
                                   "1.23456789012345678901234567890123456789012345KiB"])
def test_a_host_budget_the_engine_refuses_is_refused_naming_it(given):
    cfg = {"strata": {"host_budget": given}}
    assert isinstance(engine_config(cfg), strata.Error), "the engine takes it: the test's premise is wrong"
    with pytest.raises(strata.Error, match="strata.host_budget") as e:
        sz._host_budget(cfg)
    assert e.value.status == strata.CONFIG
    with pytest.raises(strata.Error, match="strata.host_budget"):
        sz.auto_bucket_numel(10**10, nvme(strata={"host_budget": given}))


def test_a_size_string_budget_sizes_the_buckets_as_its_bytes():
    big, ram = 10**10, 1 << 40
    by_string = sz.auto_bucket_numel(big, nvme(strata={"host_budget": "1GiB"}), host_ram_bytes=ram)
    assert by_string == sz.auto_bucket_numel(big, nvme(strata={"host_budget": 1 << 30}), host_ram_bytes=ram)
    assert by_string < sz.auto_bucket_numel(big, nvme(), host_ram_bytes=ram)


@pytest.mark.parametrize("section,enabled", [("bf16", "auto"), ("fp16", "auto"), ("bf16", None), ("bf16", True),
                                             ("bfloat16", True), ("bfloat16", "auto"), ("fp16", True)])
def test_half_precision_is_what_the_engine_reads(tmp_path, section, enabled):
    cfg = nvme(tmp_path, **{section: {"enabled": enabled}})
    seen = engine_config(cfg)
    half = seen["bf16"]["enabled"] or seen["fp16"]["enabled"]
    p_bytes = 2 if half else 4
    fp32 = sz._staged_bytes_per_element(nvme(tmp_path))
    per = sz._staged_bytes_per_element(cfg)
    assert per == fp32 - (4 - p_bytes) * (sz._slots(cfg) + sz.P_COPIES)
    lean = sz.lean_host_config(cfg, 1 << 17, on_gpu=False, world_size=1)
    assert lean["strata"]["device_budget"] == sz.P_COPIES * (1 << 17) * p_bytes + (1 << 20)
    assert seen["bf16"]["enabled"] == (section != "fp16" and enabled is True)


def test_choices_are_read_case_insensitively_as_the_engine_reads_them():
    base = sz._staged_bytes_per_element(nvme(bf16={"enabled": True}))
    compact = sz._staged_bytes_per_element(nvme(bf16={"enabled": True}, strata={"state_format": "compact"}))
    assert compact < base
    assert sz._staged_bytes_per_element(nvme(bf16={"enabled": True}, strata={"state_format": "Compact"})) == compact
    g16 = sz._staged_bytes_per_element(nvme(data_types={"grad_accum_dtype": "bf16"}))
    assert g16 < sz._staged_bytes_per_element(nvme())
    assert sz._staged_bytes_per_element(nvme(data_types={"grad_accum_dtype": "BF16"})) == g16

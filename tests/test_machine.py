"""speculum.machine: one identity of this CPU for every cache, and the busy rule of measured verdicts."""

from __future__ import annotations

import builtins
import io
import platform

import pytest
import torch

from speculum import costs, machine, row_padding
from speculum.models import dtype_probe
from speculum.runner import ModelRunner

from tiny_models import tiny_config, tiny_model

FLAGS = "fpu sse2 avx avx2 fma f16c avx512f avx512_bf16 amx_bf16 amx_tile"


def cpuinfo(name: str) -> str:
    block = f"processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: {name}\nflags\t\t: {FLAGS}\n\n"
    return block + block.replace("processor\t: 0", "processor\t: 1")


@pytest.fixture
def fake_cpu(monkeypatch):
    """``/proc/cpuinfo`` of a CPU named as set in the returned list; ``platform.processor()`` prints only
    the architecture, as it does on Linux."""
    name = ["Intel(R) Xeon(R) Platinum 8480+"]
    real_open = builtins.open

    def fake_open(file, *args, **kwargs):
        if str(file) == "/proc/cpuinfo":
            return io.StringIO(cpuinfo(name[0]))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(platform, "processor", lambda: "x86_64")
    return name


def test_two_cpu_models_with_the_same_flags_share_no_cache(fake_cpu, tmp_path, monkeypatch):
    """The cost curve, the row-padding verdict and the dtype verdict are all keyed by the CPU's model
    name, not by ``platform.processor()`` (``x86_64`` on Linux, which both CPUs print)."""
    monkeypatch.setattr(costs, "costs_dir", lambda: tmp_path)
    runner = ModelRunner(tiny_model("llama"))
    config = tiny_config("llama")

    def keys():
        return costs.machine_key(runner), row_padding._padding_path(runner), dtype_probe.cache_key(config, True)[0]

    first = keys()
    assert keys() == first  # deterministic
    fake_cpu[0] = "Intel(R) Xeon(R) Gold 6430"
    second = keys()
    assert all(a != b for a, b in zip(first, second, strict=True))
    assert machine.cpu_identity()["name"] == "Intel(R) Xeon(R) Gold 6430"


def test_an_arm_cpu_without_a_model_name_is_named_by_its_part(monkeypatch):
    real_open = builtins.open
    text = "processor\t: 0\nFeatures\t: fp asimd bf16\nCPU implementer\t: 0x41\nCPU part\t: {part}\n\n"
    part = ["0xd40"]

    def fake_open(file, *args, **kwargs):
        if str(file) == "/proc/cpuinfo":
            return io.StringIO(text.format(part=part[0]))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(platform, "processor", lambda: "aarch64")
    first = machine.cpu_identity()
    part[0] = "0xd4f"
    assert machine.cpu_identity()["name"] != first["name"] and "0xd40" in first["name"]


def test_the_caches_share_one_root(tmp_path, monkeypatch):
    from speculum.models import cache_dir

    monkeypatch.setenv(machine.CACHE_ENV, str(tmp_path))
    assert machine.cache_dir() == cache_dir() == tmp_path
    assert dtype_probe._cache_path("0" * 64).parent == tmp_path / "dtype"


@pytest.mark.parametrize(
    ("load1", "own", "cpus", "busy", "at_rest"),
    [
        (0.0, 0.0, 8, False, True),
        (2.0, 0.0, 8, False, True),  # 0.25 per CPU: at rest
        (3.0, 0.0, 8, False, False),  # between the thresholds: neither
        (4.0, 0.0, 8, False, False),  # 0.5 per CPU: not yet busy
        (4.5, 0.0, 8, True, False),
        (8.0, 4.0, 8, False, False),  # this process's own threads are not other work
        (12.0, 4.0, 8, True, False),
        (3.1, 1.0, 2, True, False),  # two CPUs: one other busy thread and a bit
        (None, 0.0, 8, False, True),  # no load average (Windows): every verdict final
    ],
)
def test_busy_rule(load1, own, cpus, busy, at_rest):
    load = machine.Load(load1, own, cpus, threads=4)
    assert load.busy is busy and load.at_rest is at_rest
    assert machine.Load.from_dict(load.to_dict()) == machine.Load(load1, round(own, 3), cpus, 4)


def test_current_load_counts_its_own_threads_at_most(monkeypatch):
    monkeypatch.setattr("os.getloadavg", lambda: (6.0, 0.0, 0.0), raising=False)
    load = machine.current_load(threads=2)
    assert load.load1 == 6.0 and load.threads == 2 and 0.0 <= load.own <= 2.0
    assert load.cpus >= 1
    assert machine.current_load().threads == torch.get_num_threads()

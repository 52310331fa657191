"""speculum.machine.measured judges the load over the measurement itself, not only the load average before.

``/proc/stat`` and this process's CPU time are faked: the machine's busy CPU time is this process's own
plus the other work a test sets, so the real load of the machine running the tests never counts. The
window's wall time is real (a short sleep).
"""

from __future__ import annotations

import builtins
import io
import json
import os
import time

import pytest

from speculum import machine

TICK = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


class FakeCpu:
    """CPU seconds had by this process (``own``) and by other work (``others``); the load average."""

    def __init__(self) -> None:
        self.own = self.others = self.load1 = 0.0

    def proc_stat(self) -> str:
        busy = round((self.own + self.others) / TICK)
        return f"cpu  {busy} 0 0 123456 0 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\n"


@pytest.fixture
def cpu(monkeypatch):
    fake = FakeCpu()
    real_open = builtins.open

    def fake_open(file, *args, **kwargs):
        if str(file) == "/proc/stat":
            return io.StringIO(fake.proc_stat())
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(time, "process_time", lambda: fake.own)
    monkeypatch.setattr(os, "getloadavg", lambda: (fake.load1, fake.load1, fake.load1), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    return fake


def measure_with(cpu: FakeCpu, *, own_threads: float = 0.0, other_threads: float = 0.0, seconds: float = 0.2):
    """A measurement that lasts ``seconds``, while this process keeps ``own_threads`` CPUs busy and other
    work ``other_threads`` CPUs; it counts its calls."""
    calls = [0]

    def measure() -> int:
        calls[0] += 1
        start = time.monotonic()
        time.sleep(seconds)
        took = time.monotonic() - start
        cpu.own += own_threads * took
        cpu.others += other_threads * took
        return calls[0]

    return measure, calls


def verdict(path, measure) -> machine.Measured[int]:
    return machine.measured(path, 1, measure, lambda v: {"v": v}, lambda doc: int(doc["v"]), what="test verdict")


def test_a_job_that_starts_while_measuring_makes_the_verdict_provisional(cpu, tmp_path):
    path = tmp_path / "verdict.json"
    # the load average before is quiet; one other busy thread on the 2 CPUs while measuring
    measure, calls = measure_with(cpu, own_threads=1.0, other_threads=1.0)
    first = verdict(path, measure)
    doc = json.loads(path.read_text())
    assert first.provisional and doc["provisional"] is True
    assert doc["load"]["load_average"] == 0.0 and doc["load"]["measuring"] > machine.WINDOW_BUSY_SHARE
    assert "while measuring" in first.describe_provisional()
    # a later load at rest measures it again, and a quiet window makes it final
    quiet, _ = measure_with(cpu, own_threads=1.0)
    rested = verdict(path, quiet)
    assert not rested.cached and not rested.provisional and json.loads(path.read_text())["provisional"] is False
    assert verdict(path, quiet).cached and calls[0] == 1


def test_a_quiet_window_keeps_the_verdict_final(cpu, tmp_path):
    measure, calls = measure_with(cpu, other_threads=0.1)  # a little background work: not busy
    first = verdict(tmp_path / "verdict.json", measure)
    assert not first.provisional and first.load is not None and first.load.measuring is not None
    assert first.load.measuring < machine.WINDOW_BUSY_SHARE
    again = verdict(tmp_path / "verdict.json", measure)
    assert again.cached and not again.provisional and calls[0] == 1


def test_its_own_cpu_use_while_measuring_is_not_other_work(cpu, tmp_path):
    measure, _ = measure_with(cpu, own_threads=2.0)  # the measurement holds both CPUs itself
    result = verdict(tmp_path / "verdict.json", measure)
    assert not result.provisional and result.load is not None and result.load.measuring == 0.0


def test_a_busy_load_average_before_measuring_keeps_a_quiet_window_provisional(cpu, tmp_path):
    cpu.load1 = 3.0  # two other threads on the 2 CPUs just before
    measure, _ = measure_with(cpu, own_threads=1.0)
    result = verdict(tmp_path / "verdict.json", measure)
    assert result.provisional and not result.load.busy_measuring


def test_without_proc_stat_the_load_average_judges_alone(cpu, tmp_path, monkeypatch):
    real_open = builtins.open

    def no_proc_stat(file, *args, **kwargs):
        if str(file) == "/proc/stat":
            raise FileNotFoundError(file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_proc_stat)
    assert machine.cpu_time() is None
    measure, _ = measure_with(cpu, other_threads=2.0)
    quiet_before = verdict(tmp_path / "quiet.json", measure)
    assert not quiet_before.provisional and quiet_before.load.measuring is None
    cpu.load1 = 10.0
    busy_before = verdict(tmp_path / "busy.json", measure)
    assert busy_before.provisional


def test_a_short_window_is_never_busy_by_rounding():
    load = machine.Load(0.0, 0.0, 2, 2)
    before = machine.CpuTime(machine=100.0, own=5.0, wall=10.0, tick=0.01)
    after = machine.CpuTime(machine=100.02, own=5.0, wall=10.001, tick=0.01)  # one tick per CPU in 1 ms
    assert load.while_measuring(before, after).measuring == 0.0
    assert load.while_measuring(before, None) == load  # no /proc/stat: not judged


@pytest.mark.parametrize(
    ("measuring", "busy"),
    [(None, False), (0.0, False), (0.33, False), (0.34, True), (1.0, True)],
)
def test_busy_rule_while_measuring(measuring, busy):
    load = machine.Load(0.0, 0.0, 2, 2, measuring)
    assert load.busy is busy and load.busy_measuring is busy and load.at_rest is not busy
    assert machine.Load.from_dict(json.loads(json.dumps(load.to_dict()))) == load


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="no /proc/stat")
def test_cpu_time_reads_this_machine():
    first = machine.cpu_time()
    assert first is not None and first.machine > 0 and first.own >= 0 and 0 < first.tick <= 0.01
    second = machine.cpu_time()
    assert second.machine >= first.machine and second.wall >= first.wall

"""This machine: what tells it apart from others, how busy it is, and measurements cached for it.

Three decisions are measured on the machine and cached on disk: the dtype of ``dtype="auto"``
(:mod:`speculum.models.dtype_probe`), the row padding of small forwards (:mod:`speculum.row_padding`)
and the cost curve of verification forwards (:mod:`speculum.costs`). They share what lives here:

- :func:`cpu_identity`: the CPU's model name (from ``/proc/cpuinfo``, never ``platform.processor()``
  first: on Linux that prints the architecture, ``x86_64``, which two CPU models share), its flags, the
  architecture, the number of CPUs and the kernels PyTorch dispatches to; part of every cache key.
- :func:`current_load`: how busy the CPUs are with other work, from the 1-minute load average.
- :func:`cpu_time`: the CPU time the whole machine and this process have spent (``/proc/stat``), sampled
  before and after a measurement to see the other work that ran while it was taken.
- :func:`measured`: measure, or read back, a verdict cached as versioned JSON with the load it was
  measured under. A verdict measured while the machine was busy, just before or while measuring, is
  *provisional*: it is used, and measured again by a later load that finds the machine at rest (then it
  is final). A verdict measured at rest is final and read back until its key changes or the caller asks
  to refresh.

The busy rule, before measuring. The load average counts runnable threads, this process's own among
them, so its own share is estimated first: the CPUs it kept busy on average since it started (CPU time
over age), at most its thread count. What is left, divided by ``os.cpu_count()`` (the load average
counts the whole machine, so all its CPUs), is the other work per CPU. Over ``BUSY_SHARE`` (0.5: other
work on half the CPUs, which with hyper-threading is a thread on every physical core) the machine is
busy. A provisional verdict is measured again only at or under ``REST_SHARE`` (0.25): the gap keeps a
load hovering near one threshold from measuring at every start.

The busy rule, while measuring. The load average moves over a minute: a job that starts just before or
during a measurement hardly shows in it. So the CPU time the machine spent busy over the measurement
(``/proc/stat``) is taken too, less this process's own (its measuring is not other work) and less one
clock tick per CPU (what ``/proc/stat``'s counts may round away, so that a short window is never busy by
rounding), per CPU and second of the window. CPU time counts what other work *got*, not what it asked
for: while the measurement's threads hold every CPU, other threads on half the CPUs (busy by the rule
above) get a third of the CPU time. So the window is busy over ``WINDOW_BUSY_SHARE``,
``BUSY_SHARE / (1 + BUSY_SHARE)`` (a third); on two CPUs, one other busy thread is enough. Where there
is no ``/proc/stat`` (macOS, Windows) the load average before measuring judges alone, and where there is
no load average either (Windows) every verdict is final.

This module imports nothing else of speculum but the file writer of :mod:`speculum.poolfile` (a leaf
too): every module may use it. torch is imported inside the functions that ask it, so that this leaf
stays cheap to import where only the cache directory or the load is needed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Generic, TypeVar

from speculum.poolfile import write_atomic

log = logging.getLogger("speculum")

CACHE_ENV = "SPECULUM_CACHE"
BUSY_SHARE = 0.5  # other work per CPU over which a measurement is provisional
REST_SHARE = 0.25  # other work per CPU at or under which a provisional one is measured again
WINDOW_BUSY_SHARE = BUSY_SHARE / (1 + BUSY_SHARE)  # CPU time other work got while measuring, per CPU
_IMPORTED = time.monotonic()  # this process's age where /proc cannot tell it

T = TypeVar("T")


def cache_dir() -> Path:
    """Root of speculum's cache: ``$SPECULUM_CACHE`` or ``~/.cache/speculum``. It holds ``dtype/`` (the
    dtype probe's timings), ``costs/`` (cost curves and row-padding verdicts), ``models/`` (GGUF files
    converted to checkpoints) and ``gguf/`` (packaged models' GGUF files, assembled while converting)."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "speculum"


def available_memory() -> int | None:
    """Bytes of memory available for new allocations (Linux), or None where unknown."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cpu_identity() -> dict[str, Any]:
    """What tells one CPU from another: its model name, its flags (hashed), the architecture, the number
    of CPUs and the kernels PyTorch dispatches to."""
    name = flags = ""
    parts: dict[str, str] = {}  # ARM's /proc/cpuinfo names the core by these instead of a model name
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                field, _, value = line.partition(":")
                field, value = field.strip(), value.strip()
                if field == "model name" and not name:
                    name = value
                elif field in ("flags", "Features") and not flags:
                    flags = " ".join(sorted(value.split()))
                elif field in ("CPU implementer", "CPU part", "CPU variant") and field not in parts:
                    parts[field] = value
                if not line.strip() and (name or flags):
                    break  # the first processor's block says it all
    except OSError:
        pass
    if not name and parts:
        name = " ".join(f"{k}={v}" for k, v in sorted(parts.items()))
    try:
        import torch  # lazily: see the module docstring

        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # pragma: no cover - old torch
        capability = ""
    return {
        "name": name or platform.processor() or platform.machine(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "capability": capability,
    }


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The x86 CPU's feature flags (``/proc/cpuinfo``), empty where they cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_fast_bf16() -> bool:
    """True when the CPU has native bfloat16 matrix instructions (AVX-512 BF16 or AMX)."""
    if flags := cpu_flags():
        return bool(flags & {"avx512_bf16", "amx_bf16"})
    import torch  # lazily: see the module docstring

    try:  # no /proc (macOS, Windows): fall back on the capability PyTorch dispatches to
        return torch.backends.cpu.get_cpu_capability() == "AVX512_BF16"  # pragma: no cover
    except Exception:  # pragma: no cover
        return False


def native_bf16(device: Any) -> bool:
    """True when ``device`` computes bfloat16 natively (a CUDA GPU that supports it, or a CPU with
    AVX-512 BF16 / AMX)."""
    import torch  # lazily: see the module docstring

    if torch.device(device).type == "cuda":
        return torch.cuda.is_bf16_supported()
    return cpu_has_fast_bf16()


# ------------------------------------------------------------------------------------------------ load


@dataclass(frozen=True)
class Load:
    """How busy the machine was: the 1-minute load average (None where there is none), this process's
    own estimated share of it, the CPUs and this process's threads; ``measuring``: the CPU time other
    work got while measuring, per CPU (None: not measured, or no ``/proc/stat``)."""

    load1: float | None
    own: float
    cpus: int
    threads: int
    measuring: float | None = None

    @property
    def others(self) -> float | None:
        """Other work per CPU from the load average (see the module's docstring), or None without one."""
        if self.load1 is None:
            return None
        return max(0.0, self.load1 - self.own) / max(self.cpus, 1)

    @property
    def busy_measuring(self) -> bool:
        return self.measuring is not None and self.measuring > WINDOW_BUSY_SHARE

    @property
    def busy(self) -> bool:
        others = self.others
        return self.busy_measuring or (others is not None and others > BUSY_SHARE)

    @property
    def at_rest(self) -> bool:
        others = self.others
        return not self.busy_measuring and (others is None or others <= REST_SHARE)

    def describe(self) -> str:
        text = f"load {self.load1:.1f} on {self.cpus} CPUs" if self.load1 is not None else "load unknown"
        if self.measuring is not None:
            text += f", other work on {self.measuring * self.cpus:.1f} CPUs while measuring"
        return text

    def while_measuring(self, before: CpuTime | None, after: CpuTime | None) -> Load:
        """This load with the CPU time other work got between two samples of :func:`cpu_time`."""
        if before is None or after is None:
            return self
        cpus = max(self.cpus, 1)
        others = (after.machine - before.machine) - (after.own - before.own) - cpus * after.tick
        seconds = max(after.wall - before.wall, after.tick)
        return replace(self, measuring=max(0.0, others) / (seconds * cpus))

    def to_dict(self) -> dict[str, Any]:
        return {
            "load_average": self.load1,
            "own": round(self.own, 3),
            "cpus": self.cpus,
            "threads": self.threads,
            "measuring": None if self.measuring is None else round(self.measuring, 3),
            "busy": self.busy,
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Load:
        load1, measuring = doc.get("load_average"), doc.get("measuring")
        return cls(
            None if load1 is None else float(load1),
            float(doc.get("own", 0.0)),
            int(doc["cpus"]),
            int(doc["threads"]),
            None if measuring is None else float(measuring),
        )


@dataclass(frozen=True)
class CpuTime:
    """CPU seconds spent so far by the whole machine (all CPUs) and by this process, at ``wall``
    (``time.monotonic()``); ``tick``: the unit ``/proc/stat`` counts in."""

    machine: float
    own: float
    wall: float
    tick: float


def cpu_time() -> CpuTime | None:
    """The CPU time spent so far, or None where ``/proc/stat`` cannot tell it (not Linux)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
        if fields[0] != "cpu":
            raise ValueError("no cpu line")
        # user, nice, system, idle, iowait, irq, softirq, steal: all but idle and iowait kept a CPU
        # busy (steal too: another virtual machine had it); guest time is already counted in user
        ticks = [int(field) for field in fields[1:9]]
        busy = sum(ticks) - sum(ticks[3:5])
        tick = 1.0 / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return CpuTime(busy * tick, time.process_time(), time.monotonic(), tick)


def _own_cpus() -> float:
    """CPUs this process kept busy on average since it started: its own part of the load average."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime", encoding="ascii") as f:
            age = float(f.read().split()[0]) - started
    except (OSError, ValueError, IndexError, AttributeError):
        age = time.monotonic() - _IMPORTED
    return time.process_time() / max(age, 1.0)


def current_load(threads: int | None = None) -> Load:
    """The machine's load now; ``threads``: this process's compute threads (torch's by default)."""
    if threads is None:
        try:
            import torch  # lazily: see the module docstring

            threads = torch.get_num_threads()
        except Exception:  # pragma: no cover - torch is always there in practice
            threads = 1
    try:
        load1: float | None = os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows
        load1 = None
    return Load(load1, min(float(threads), _own_cpus()), os.cpu_count() or 1, threads)


# ------------------------------------------------------------------------------------------------ the caches


@dataclass(frozen=True)
class Measured(Generic[T]):
    """A verdict from :func:`measured`: ``cached``: read back, not measured now; ``provisional``: measured
    while the machine was busy, just before or while measuring (used, and measured again at rest);
    ``load``: the load it was measured under; ``seconds``: time spent measuring now; ``path``: the file
    that holds it (None: not written)."""

    value: T
    cached: bool
    provisional: bool
    load: Load | None
    seconds: float = 0.0
    path: Path | None = None

    def describe_provisional(self) -> str:
        """Empty for a final verdict, else why it is provisional."""
        if not self.provisional:
            return ""
        where = f" ({self.load.describe()})" if self.load is not None else ""
        return f"provisional: measured while the CPU was busy{where}, measured again at rest"


def measured(
    path: Path,
    version: int,
    measure: Callable[[], T],
    encode: Callable[[T], dict[str, Any]],
    decode: Callable[[dict[str, Any]], T],
    *,
    refresh: bool = False,
    what: str = "measurement",
) -> Measured[T]:
    """The verdict cached at ``path``, or ``measure()`` now and cached there.

    The file is JSON: ``encode(value)``'s fields with ``version``, ``provisional``, ``load`` (the load
    average before measuring and the other work while measuring) and ``seconds`` beside them. It is read
    back when its version is ``version`` and ``decode`` accepts it (it raises ``ValueError``,
    ``KeyError``, ``TypeError`` or ``AttributeError`` otherwise: measured again, never an error), unless
    ``refresh``, or it is provisional and the machine is now at rest. What ``measure``
    raises propagates; a file that cannot be written costs a re-measure next time, nothing more."""
    found = None
    if not refresh:
        found = read_cached(path, version, decode, what)
        if found is not None:
            value, provisional, load = found
            if not provisional:
                return Measured(value, True, False, load, path=path)
            now = current_load()
            if not now.at_rest:  # still busy: the provisional verdict is the best there is
                return Measured(value, True, True, load, path=path)
            log.info("speculum: the %s was measured while the CPU was busy; measuring it again at rest", what)
    load = current_load()  # before measuring: its own threads are not other work
    before = cpu_time()
    start = time.perf_counter()
    try:
        value = measure()
    except Exception:
        if found is None:
            raise
        log.warning("speculum: measuring the %s again failed; keeping the provisional one", what, exc_info=True)
        return Measured(found[0], True, True, found[2], path=path)
    seconds = time.perf_counter() - start
    load = load.while_measuring(before, cpu_time())  # a job that started meanwhile is not in the load average
    doc = {**encode(value), "version": version, "provisional": load.busy, "load": load.to_dict(), "seconds": seconds}
    written: Path | None = path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, (json.dumps(doc, indent=1, default=str) + "\n").encode())
    except OSError as error:  # a read-only cache: the verdict is still used, just not remembered
        log.warning("speculum: could not cache the %s in %s (%s)", what, path, error)
        written = None
    if load.busy:
        log.info("speculum: %s measured while the CPU was busy (%s): provisional", what, load.describe())
    return Measured(value, False, load.busy, load, seconds, written)


def read_cached(path: Path, version: int, decode, what: str) -> tuple[Any, bool, Load | None] | None:
    """(value, provisional, load) of the cache file at ``path`` (see :func:`measured`), or None where it
    is missing or unusable (logged)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(doc, dict) or doc.get("version") != version:
            raise ValueError("another version")
        value = decode(doc)
        provisional = doc.get("provisional", False)
        if not isinstance(provisional, bool):
            raise ValueError("bad provisional flag")
        try:
            load = Load.from_dict(doc["load"])
        except (KeyError, TypeError, ValueError):
            load = None
        return value, provisional, load
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        log.info("speculum: ignoring the %s cache file %s (%s); measuring again", what, path, error)
        return None


def finite_positive(value: Any) -> bool:
    """A timing a cache file may hold: a finite number above zero."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0

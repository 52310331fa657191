"""Verdicts measured while the CPU was busy are provisional: used, then measured again at rest.

The dtype choice (speculum.models.dtypes), the cost curve (speculum.costs) and the row padding
(speculum.accel) each cache a measurement through speculum.machine.measured; here their measuring
is replaced by a counter, and the load average is set by the test.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from speculum import accel, costs, machine, models, row_padding
from speculum.cli import app
from speculum.costs import CostModel
from speculum.models import dtype_probe, dtypes
from speculum.runner import ModelRunner

from tiny_models import tiny_config, tiny_model

BUSY, AT_REST = 100.0, 0.0
PADDING_MS = {"1": 15.0, "1 padded": 10.0, "2": 17.0, "2 padded": 10.0}


@pytest.fixture
def load(monkeypatch, tmp_path):
    """The 1-minute load average the caches see (set ``load[0]``); every cache in ``tmp_path``. No CPU
    time is read while measuring (tests/test_machine_window.py judges that): the load average alone."""
    value = [AT_REST]
    monkeypatch.setattr("os.getloadavg", lambda: (value[0], value[0], value[0]), raising=False)
    monkeypatch.setattr(machine, "cpu_time", lambda: None)
    monkeypatch.setenv("SPECULUM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(costs, "costs_dir", lambda: tmp_path / "costs")
    monkeypatch.delenv(dtypes.MEASURE_ENV, raising=False)
    monkeypatch.delenv(row_padding.PAD_ENV, raising=False)
    monkeypatch.setattr(machine, "cpu_has_fast_bf16", lambda: True)
    return value


class Cache:
    """One of the three caches: ``verdict()`` loads it (measuring or not), ``provisional(v)`` reads the
    loaded verdict's flag, ``file()`` the cache file; ``measured`` counts measurements."""

    def __init__(self, kind: str, monkeypatch):
        self.kind, self.measured = kind, 0

        def count(value):
            def measure(*args, **kwargs):
                self.measured += 1
                return value() if callable(value) else value

            return measure

        if kind == "dtype":
            monkeypatch.setattr(dtype_probe, "_measure", count({"prepacked float32": 2.0, "bfloat16": 1.0}))
        elif kind == "costs":
            self.runner = ModelRunner(tiny_model("llama"))
            curve = count(lambda: CostModel([(1, 0.010), (2, 0.011), (4, 0.012)]))
            monkeypatch.setattr(CostModel, "measure", classmethod(lambda cls, *a, **k: curve()))
        else:
            self.runner = ModelRunner(tiny_model("llama"))
            accel.prepack(self.runner.model)
            monkeypatch.setattr(row_padding, "_time_padding", count(dict(PADDING_MS)))

    def verdict(self):
        if self.kind == "dtype":
            return models.choose_dtype("auto", "cpu", tiny_config("llama"))
        if self.kind == "costs":
            return costs.measured_cost_model(self.runner)
        return row_padding.choose_row_padding(self.runner)

    def provisional(self, verdict) -> bool:
        return bool(verdict.provisional)

    def file(self) -> dict:
        if self.kind == "dtype":
            (path,) = (machine.cache_dir() / "dtype").glob("*.json")
        elif self.kind == "costs":
            path = costs.costs_dir() / f"{costs.machine_key(self.runner)}.json"
        else:
            path = row_padding._padding_path(self.runner)
        return json.loads(path.read_text())


KINDS = ["dtype", "costs", "rows"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_verdict_measured_while_busy_is_provisional_and_measured_again_at_rest(kind, load, monkeypatch):
    cache = Cache(kind, monkeypatch)
    load[0] = BUSY
    first = cache.verdict()
    assert cache.measured == 1 and cache.provisional(first)
    doc = cache.file()
    assert doc["provisional"] is True and doc["load"]["load_average"] == BUSY and doc["load"]["busy"] is True
    assert doc["load"]["cpus"] >= 1 and doc["load"]["threads"] == torch.get_num_threads()
    assert "provisional: measured while the CPU was busy" in first.describe()
    again = cache.verdict()  # still busy: the provisional verdict is used, not measured again
    assert cache.measured == 1 and cache.provisional(again)
    load[0] = AT_REST
    rested = cache.verdict()  # at rest: measured again, and final
    assert cache.measured == 2 and not cache.provisional(rested)
    assert cache.file()["provisional"] is False
    assert "provisional" not in rested.describe()
    cache.verdict()
    load[0] = BUSY
    cache.verdict()  # a final verdict is kept, busy or not
    assert cache.measured == 2


@pytest.mark.parametrize("kind", KINDS)
def test_a_verdict_measured_at_rest_is_final(kind, load, monkeypatch):
    cache = Cache(kind, monkeypatch)
    first = cache.verdict()
    assert cache.measured == 1 and not cache.provisional(first) and cache.file()["provisional"] is False
    second = cache.verdict()
    assert cache.measured == 1 and not cache.provisional(second)


@pytest.mark.parametrize("kind", KINDS)
def test_refresh_measures_a_final_verdict_again_and_a_busy_cpu_makes_it_provisional(kind, load, monkeypatch):
    cache = Cache(kind, monkeypatch)
    cache.verdict()
    assert cache.file()["provisional"] is False
    load[0] = BUSY
    if kind == "dtype":
        monkeypatch.setenv(dtypes.MEASURE_ENV, "refresh")
        cache.verdict()
    elif kind == "costs":
        costs.measured_cost_model(cache.runner, refresh=True)
    else:
        monkeypatch.setenv(row_padding.PAD_ENV, "refresh")
        cache.verdict()
    assert cache.measured == 2 and cache.file()["provisional"] is True


def test_a_provisional_verdict_is_kept_where_measuring_it_again_fails(load, monkeypatch):
    cache = Cache("rows", monkeypatch)
    load[0] = BUSY
    cache.verdict()
    load[0] = AT_REST

    def broken(*args):
        raise RuntimeError("no oneDNN today")

    monkeypatch.setattr(row_padding, "_time_padding", broken)
    kept = cache.verdict()
    assert kept.rows == row_padding.PAD_ROWS and kept.provisional


def test_stats_say_when_the_dtype_and_the_cost_curve_are_provisional(load, monkeypatch, model_dir):
    monkeypatch.setattr(
        dtype_probe, "_measure", lambda config, prepack, exact=False: {"prepacked float32": 1.0, "bfloat16": 2.0}
    )
    monkeypatch.setenv(row_padding.PAD_ENV, "0")
    args = ["generate", "w1 w2 w3 w4 w1 w2 w3", "--model", model_dir, "--max-new-tokens", "4", "--no-stream"]
    load[0] = BUSY
    result = CliRunner().invoke(app, args)  # the default method: auto, with the controller's cost curve
    assert result.exit_code == 0, result.output
    busy = "provisional: measured while the CPU was busy"
    dtype_line = next(line for line in result.output.splitlines() if line.startswith("dtype: "))
    cost_line = next(line for line in result.output.splitlines() if line.startswith("verification costs: "))
    assert busy in dtype_line and busy in cost_line and "t(1) " in cost_line
    load[0] = AT_REST
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert busy not in result.output and "verification costs: t(1) " in result.output

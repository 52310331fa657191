"""Benchmarks: run decoding methods side by side on public prompt sets, check losslessness, report.

``run_bench(spec, datasets, methods, ...) -> BenchResult`` is the entry point for scripts; the
``speculum bench`` command (:func:`speculum.bench.command.bench`) wraps it.
"""

from speculum.bench.datasets import DATASETS, Prompt, load_dataset, load_datasets, load_question_file
from speculum.bench.method_specs import HF_METHODS, MethodSpec, parse_method_spec, parse_methods
from speculum.bench.report import summarize, summarize_records, to_markdown, write_result
from speculum.bench.runner import BenchResult, interleaved_order, run_bench

__all__ = [
    "DATASETS",
    "HF_METHODS",
    "BenchResult",
    "MethodSpec",
    "Prompt",
    "interleaved_order",
    "load_dataset",
    "load_datasets",
    "load_question_file",
    "parse_method_spec",
    "parse_methods",
    "run_bench",
    "summarize",
    "summarize_records",
    "to_markdown",
    "write_result",
]

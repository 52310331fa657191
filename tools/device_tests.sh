#!/usr/bin/env bash
# The tiny-model tests on a lent GPU (the device tool's machine), every tiny model on CUDA.
#
# Nothing can be fetched there: carry, in .whl/ (ignored by git: `echo /.whl/ >> .git/info/exclude`),
# the wheels of what its image lacks or holds in another version, e.g. here
#   pip download --no-deps -d .whl transformers==5.24.0 gguf
# then, through the device tool with carry [".whl"]:
#   bash tools/device_tests.sh 480 tests/test_sampling.py tests/test_auto.py ...
# (seconds for pytest, then test files; default: the files below). The wheels go to a folder of
# their own put first on PYTHONPATH, so the image's own versions cannot shadow them, and the
# versions imported are printed. Each test's outcome is written as it ends (-v), so a run that the
# lease cuts short still says which tests passed and which failed ($OUT/pytest.log, then a summary)
# and why: each failure's traceback goes to $OUT/failures.log as the test ends (the pytest plugin
# tests/failures_as_they_happen.py, found through PYTHONPATH).
set -uo pipefail
cd "$(dirname "$0")/.."
LIMIT=${1:-480}
shift || true
FILES=("$@")
if [ ${#FILES[@]} -eq 0 ]; then
  FILES=(tests/test_sampling.py tests/test_auto.py tests/test_controller.py tests/test_batch.py tests/test_devices.py
         tests/test_lossless.py tests/test_draft_heads.py tests/test_tree_cache.py)
fi
OUT=${OUT:-/tmp/device-tests}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target .pylib .whl/*.whl 2>&1 | grep -v "as the 'root' user" || true
fi
export PYTHONPATH=$PWD/.pylib:$PWD/src:$PWD/tests FAILURE_LOG=$OUT/failures.log
# one CPU thread per worker: 16 workers of 16 threads each made the CPU-bound tests (the sampling
# rule's 6,000 trials, the heads' training) overrun their timeout on the 16-core machine
export OMP_NUM_THREADS=1
python3 -c "import torch, transformers, speculum; print('torch', torch.__version__, 'transformers', transformers.__version__,
      'from', transformers.__file__, '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
SPECULUM_TEST_DEVICE=cuda timeout "$LIMIT" python3 -m pytest -v -n "${WORKERS:-16}" -p no:cacheprovider -p no:benchmark \
    -p failures_as_they_happen --timeout "${TEST_TIMEOUT:-240}" --tb=short "${FILES[@]}" >"$OUT/pytest.log" 2>&1
echo "pytest exit status $? (124: cut at ${LIMIT} s)"
echo "passed: $(grep -c ' PASSED ' "$OUT/pytest.log"), skipped: $(grep -c ' SKIPPED ' "$OUT/pytest.log")"
grep -E ' (FAILED|ERROR) ' "$OUT/pytest.log" | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //' | sort -u | head -60
grep -E '^E  ' "$OUT/pytest.log" | sort | uniq -c | sort -rn | head -20

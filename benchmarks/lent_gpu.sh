#!/usr/bin/env bash
# Runs suite parts on a lent GPU machine inside one command's time limit and packs every result into one file:
#   bash benchmarks/lent_gpu.sh PARTS [SECONDS]  e.g.  bash benchmarks/lent_gpu.sh xxl_1gpu 560
#   bash benchmarks/lent_gpu.sh decoding         the decoding plan (benchmarks/suite.py's DECODING) in 480 s
#   bash benchmarks/lent_gpu.sh fifteen          the fifteen-minute plan (benchmarks/suite.py's FIFTEEN) in 480 s
# The queue of what a lent GPU runs first, in order: docs/gpu_suite.md
# The results (each part's JSON, each run's report and log, summary.md) go to /tmp/suite, which a warm machine
# keeps between commands (its JAX compilation cache too), and are packed into $OUT/suite_<parts>.tgz even when
# the time limit stops the suite partway (each finished run's report is already on disk).
set -u
parts=$1 budget=${2:-465}  # (fifteen, decoding: the whole command within 480 s)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())"
timeout $((${budget%.*} + 5)) python3 benchmarks/suite.py --out /tmp/suite --budget "$budget" --only "$parts"
echo "suite exit $?"
cat /tmp/suite/summary.md 2>/dev/null
tar czf "${OUT:-/tmp}/suite_${parts//,/_}.tgz" -C /tmp/suite --exclude jax_cache --exclude xl_profile .

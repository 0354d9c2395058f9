#!/usr/bin/env bash
# One device call: GPU tests first (kernels, then the engine), then benchmarks.
#   bash benchmarks/gpu_suite.sh tests|engine-tests|kernels|bench-a|bench-b ...   (parts run in order)
# Results and logs go to $OUT (the device tool brings them back).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-benchmarks/results/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/nvidia-smi.txt"
for part in "$@"; do
  case $part in
    tests)
      python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_triton_gpu.py tests/test_gpu_engine.py \
        2>&1 | tee "$OUT/gpu-tests.log" | tail -25 ;;
    engine-tests)
      python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py 2>&1 | tee "$OUT/gpu-engine-tests.log" | tail -15 ;;
    kernels)
      python3 benchmarks/bench_kernels.py --out "$OUT/bench_kernels.json" 2>&1 | tail -25 ;;
    bench-a)
      python3 benchmarks/run_engine_bench.py startup --out "$OUT/startup.json" --no-peer
      python3 benchmarks/run_engine_bench.py latency --out "$OUT/latency.json"
      python3 benchmarks/run_engine_bench.py batch --out "$OUT/batch.json" ;;
    bench-b)
      python3 benchmarks/run_engine_bench.py throughput --out "$OUT/throughput.json" --peer-requests 16
      python3 benchmarks/run_engine_bench.py features --out "$OUT/features.json" --no-peer ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done

"""Tensor parallelism on two GPUs (``tokenmill/bench/tensor_parallel.py``):
python benchmarks/suite/tp_bench.py allreduce|decode|70b|all [--out F]."""

import sys

from tokenmill.bench.tensor_parallel import main

if __name__ == "__main__":
    sys.exit(main())

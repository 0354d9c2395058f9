"""``tokenmill bench`` without the server's dependencies (FastAPI and the rest need not be installed):
python benchmarks/suite/run_engine_bench.py latency|batch|throughput|features|startup|models|kvcache|kvcache-long|spec|weights|all
    [--shapes S] [--no-peer] [--out F]   (GPU; --help lists the options)"""

import argparse
import sys

from tokenmill.bench.offline import BENCHMARKS, add_bench_args, run_bench


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("bench_command", choices=BENCHMARKS)
    add_bench_args(parser)
    return run_bench(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())

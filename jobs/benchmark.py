"""spark-submit entry point of the benchmark: `spark-submit jobs/benchmark.py [kfed-spark bench options]`."""

import sys

from kfed_spark.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))

"""spark-submit entry point: `spark-submit jobs/kfed_job.py --config conf/cluster.yaml [--set KEY=VALUE ...]`.

It is `kfed-spark run` with the same arguments; the session spark-submit started is reused.
"""

import sys

from kfed_spark.cli import main

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))

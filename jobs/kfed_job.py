"""spark-submit entry point: `spark-submit jobs/kfed_job.py --config conf/cluster.yaml [--set KEY=VALUE ...]`.

It is `kfed-spark run` with the same arguments, or the command its first argument names (run, assign,
stream: `spark-submit jobs/kfed_job.py stream --available-now --config ...`); the session spark-submit
started is reused.
"""

import sys

from kfed_spark.cli import main

COMMANDS = ("run", "assign", "stream")

if __name__ == "__main__":
    arguments = sys.argv[1:]
    sys.exit(main(arguments if arguments[:1] and arguments[0] in COMMANDS else ["run", *arguments]))

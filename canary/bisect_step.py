"""One `git bisect run` step: run the check command and map its exit status (see canary.cli.bisect)."""

import sys

from canary.cli.bisect import run_step

if __name__ == "__main__":
    sys.exit(run_step(" ".join(sys.argv[1:])))

"""One `git bisect run` step: run the check command and map its exit status (see canary.bisect)."""

import sys

from canary.bisect import run_step

if __name__ == "__main__":
    sys.exit(run_step(" ".join(sys.argv[1:])))

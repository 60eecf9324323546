"""`python -m canary <command>`: golden record/check, bisect, the fault matrix and an A/B baseline server."""

from __future__ import annotations

import argparse
import sys

from canary.cli import baseline_server, bisect
from canary.cli import faults as faults_cli
from canary.cli import golden as golden_cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m canary", description="DSV4 canary suite tools")
    sub = parser.add_subparsers(dest="command", required=True)
    golden_cli.add_parser(sub)
    bisect.add_parser(sub)
    faults_cli.add_parser(sub)
    baseline_server.add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

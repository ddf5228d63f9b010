"""The entry of a component benchmark that computes one result: flags → run → its table on
stdout, and with `--json PATH` the same figures written as JSON."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any


def figures_main(
    argv: list[str],
    parse_args: Callable[[list[str]], argparse.Namespace],
    run: Callable[[argparse.Namespace], dict[str, Any]],
    format_result: Callable[[dict[str, Any]], str],
) -> int:
    """Parse `argv`, run, print `format_result(result)`, write `result` to `--json` when given
    (the parser must define `--json`); 0."""
    args = parse_args(argv)
    result = run(args)
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0

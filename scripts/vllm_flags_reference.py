#!/usr/bin/env python3
"""Write ``schemas/vllm_serve_flags.json``: every option of ``vllm serve`` as vLLM itself builds it.

Run where vLLM is importable (any machine with ``pip install vllm==VERSION``; pkgd never
depends on it): ``python scripts/vllm_flags_reference.py > schemas/vllm_serve_flags.json``.
The file is reference data for `pkgd.config.vllm_flags` and its drift test: which flags
vLLM's parser registers, how many values each takes (argparse ``nargs``: 0 for a switch,
null for one value, "+" for one or more, "?" for an optional one) and its argument group.
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    import vllm
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    group_of = {id(a): g.title for g in parser._action_groups for a in g._group_actions}
    flags = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        nargs = action.nargs
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            nargs = 0
        flags.append({"flags": list(action.option_strings), "nargs": nargs, "group": group_of.get(id(action))})
    # one flag per line, so a new vLLM release shows as a readable diff
    rows = ",\n".join("  " + json.dumps(f) for f in flags)
    sys.stdout.write(
        f'{{\n "vllm_version": {json.dumps(vllm.__version__)},\n "command": "vllm serve",\n'
        f' "flags": [\n{rows}\n ]\n}}\n'
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m planner calibrate|plan ...``: the same commands as ``kvasir calibrate|plan``, for an
install whose entry points predate them (an editable install made before planner/ was added)."""

import sys

from kvasir_bus import cli

if "planner.cli" not in cli.CORE_MODULES:
    cli.CORE_MODULES = (*cli.CORE_MODULES, "planner.cli")
sys.exit(cli.main())

"""``python -m loopprobe.cli``: the same as the ``loopprobe`` console script."""

from loopprobe.cli import main

raise SystemExit(main())

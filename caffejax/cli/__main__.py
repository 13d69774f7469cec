"""``python -m caffejax.cli``: the same as the ``caffejax`` command."""

import sys

from caffejax.cli import main

sys.exit(main())

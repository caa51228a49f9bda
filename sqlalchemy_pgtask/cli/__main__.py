"""``python -m sqlalchemy_pgtask.cli``: the ``pgtask`` command without its console script."""

import sys

from sqlalchemy_pgtask.cli import main

sys.exit(main())

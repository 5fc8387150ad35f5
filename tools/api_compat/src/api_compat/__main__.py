"""``python -m api_compat``: the ``api-compat`` command."""

import sys

from api_compat.cli import main

sys.exit(main())

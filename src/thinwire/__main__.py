"""``python -m thinwire`` is the same as the ``thinwire`` command."""

import sys

from thinwire.cli.entry import main

sys.exit(main())

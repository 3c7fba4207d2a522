"""``python -m dynarec`` (and ``torchrun -m dynarec``): the ``dynarec`` command."""

import sys

from dynarec.cli import main

sys.exit(main())

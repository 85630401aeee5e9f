"""``python -m eplb`` runs the ``eplb`` command."""

from __future__ import annotations

import sys

from eplb.cli import main

sys.exit(main())

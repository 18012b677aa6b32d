"""``python -m balancer`` runs the ``wslb`` command."""

import sys

from balancer.cli import main

sys.exit(main())

"""``python -m backends``: run the reference worker (same as ``wslb-worker``)."""

from backends.worker import main

main()

"""What the benchmark scripts share, so that no script imports another.

``launch`` starts and stops processes (the integration tests use it too, as ``tests.procs``);
``machine`` is the one description of the machine a report prints; ``stats`` the one percentile
summary; the rest are helpers more than one script needs (CPU accounting, wslb seen from
outside, the load generators, the chat client, the raw WebSocket peers, a script's plumbing).
A script imports ``bench.lib`` and, for llama-server, ``tests.engines``; nothing else of
``bench/`` or ``tests/`` (``tests/test_bench_lib.py`` checks it).
"""

"""WebSocket conformance: the Autobahn fuzzingclient through wslb vs. a direct echo worker."""

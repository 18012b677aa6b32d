"""Client side of wslb: ``wslb.client`` is an asyncio WebSocket client that resumes its session
by itself after a network loss (docs/resume.md)."""

"""The admin API's own description (``GET /openapi.json``), OpenAPI 3.1."""

from __future__ import annotations

from typing import Any

__all__ = ["OPENAPI"]


def _op(
    summary: str,
    ok: str = "200",
    body: dict[str, Any] | None = None,
    errors: tuple[str, ...] = ("401",),
) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": summary,
        "responses": {ok: {"description": "OK", "content": {"application/json": {}}}},
    }
    for code in errors:
        op["responses"][code] = {"$ref": f"#/components/responses/E{code}"}
    if body is not None:
        op["requestBody"] = {"content": {"application/json": {"schema": body}}}
    return op


_ID = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
_SID = {"name": "sid", "in": "path", "required": True, "schema": {"type": "string"}}

OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "wslb admin API", "version": "1"},
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "schemas": {
            "Error": {
                "type": "object",
                "properties": {"error": {"type": "string"}},
                "required": ["error"],
            },
            "Health": {
                "type": "object",
                "description": "Active health checks: why a backend is down, and when.",
                "properties": {
                    "ok": {"type": "boolean"},
                    "reason": {
                        "type": ["string", "null"],
                        "description": "e.g. 'connect refused', 'GET /healthz -> 404'; null if up",
                    },
                    "since": {"type": ["number", "null"], "description": "Unix time of the flip"},
                    "last_check": {"type": ["number", "null"], "description": "Unix time"},
                },
                "required": ["ok", "reason", "since", "last_check"],
            },
        },
        "responses": {
            f"E{c}": {
                "description": d,
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
            }
            for c, d in (
                ("400", "Bad request"),
                ("401", "Missing or wrong bearer token"),
                ("403", "Cross-origin request, or a DNS name in Host on a loopback listener"),
                ("415", "A POST whose Content-Type is not application/json"),
                ("404", "Not found"),
                ("409", "Conflict with the current state"),
                ("503", "Cluster mode: etcd unreachable, nothing was written"),
            )
        },
    },
    "security": [{"bearer": []}],
    "paths": {
        "/healthz": {"get": {**_op("Liveness", errors=()), "security": []}},
        "/readyz": {
            "get": {
                **_op(
                    "Readiness: 503 while shutting down; in cluster mode 200 with degraded: true"
                    " and a cluster object while etcd is unreachable",
                    errors=(),
                ),
                "security": [],
            }
        },
        "/version": {
            "get": _op("The code serving: {version, started (ISO 8601, when it was loaded), pid}")
        },
        "/metrics": {"get": _op("Prometheus metrics (text format)")},
        "/backends": {
            "get": _op(
                "Backends with state, health (a Health object), weights, sessions, signals, "
                "drain progress"
            ),
            "post": _op(
                "Add a backend",
                "201",
                {
                    "type": "object",
                    "required": ["id", "url"],
                    "properties": {
                        "id": {"type": "string"},
                        "url": {"type": "string"},
                        "weight": {"type": "number"},
                        "pool": {"type": "string"},
                        "metrics_url": {"type": "string"},
                    },
                },
                ("400", "401", "404", "409", "503"),
            ),
        },
        "/backends/{id}": {
            "parameters": [_ID],
            "get": _op("One backend", errors=("401", "404")),
            "delete": _op("Remove a drained backend", errors=("401", "404", "409", "503")),
        },
        "/backends/{id}/drain": {
            "parameters": [_ID],
            "post": _op(
                "Drain: no new sessions; live ones migrated or closed 1012",
                "202",
                {
                    "type": "object",
                    "properties": {
                        "migrate": {"type": "boolean"},
                        "timeout": {"type": ["string", "number"]},
                    },
                },
                ("400", "401", "404", "409", "503"),
            ),
        },
        "/backends/{id}/undrain": {
            "parameters": [_ID],
            "post": _op("Back to active", errors=("401", "404", "503")),
        },
        "/sessions": {
            "get": {
                **_op("Live sessions"),
                "parameters": [
                    {
                        "name": "backend",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "string"},
                    }
                ],
            }
        },
        "/sessions/{sid}": {
            "parameters": [_SID],
            "get": _op("One live session", errors=("401", "404")),
        },
        "/sessions/{sid}/migrate": {
            "parameters": [_SID],
            "post": _op(
                "Move one live session (to a named backend, or where the ring says)",
                body={"type": "object", "properties": {"to": {"type": "string"}}},
                errors=("400", "401", "404", "409"),
            ),
        },
        "/reload": {
            "post": _op(
                "Reread the config file (backends and weights apply)", errors=("400", "401")
            )
        },
        "/restart": {
            "post": _op(
                "Hot restart: the code installed now takes over the listeners and every live "
                "session; answered when it has (what moved, what did not and why)",
                errors=("401", "409", "500", "501"),
            )
        },
        "/openapi.json": {"get": _op("This document")},
        "/debug/stats": {"get": _op("Process figures: asyncio tasks, sessions, RSS, open FDs")},
        "/events": {
            "get": _op(
                "Events after ?since=N (drains, migrations, failovers, state changes, reloads), "
                "waiting up to ?wait=S seconds (at most 30) for one: a long poll",
                errors=("400", "401"),
            )
        },
        "/events/stream": {
            "get": {
                "summary": "The same events as server-sent events: the recent backlog, then live",
                "responses": {
                    "200": {"description": "OK", "content": {"text/event-stream": {}}},
                    "401": {"$ref": "#/components/responses/E401"},
                },
            }
        },
        "/ui": {
            "get": {
                "summary": "The operator dashboard: a web page (no token; its data calls use it)",
                "responses": {"200": {"description": "OK", "content": {"text/html": {}}}},
                "security": [],
            }
        },
    },
}


def _guarded(spec: dict[str, Any]) -> dict[str, Any]:
    """Every route answers 403 to a foreign Origin or a rebinding Host; a POST 415 to a body
    that is not JSON (``admin.py``'s guard runs before any handler)."""
    for item in spec["paths"].values():
        for method, op in item.items():
            if method == "parameters":
                continue
            op["responses"]["403"] = {"$ref": "#/components/responses/E403"}
            if method == "post":
                op["responses"]["415"] = {"$ref": "#/components/responses/E415"}
    return spec


OPENAPI = _guarded(OPENAPI)

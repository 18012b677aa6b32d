"""Handshake auth: JWT (pinned algorithms, exp, aud, alg=none) and origins, before any worker."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import h11
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from balancer.auth import Authenticator, normalise_origin
from balancer.config import AuthCfg, JwtCfg
from balancer.handshake import HandshakeReject, check_client_request
from tests.procs import Worker, Wslb, pool_config
from tests.wsraw import RawClient

SECRET = "a-long-shared-secret-for-hs256-tests-" + "x" * 40  # 64+ bytes: fine for HS512 too


def request(target: str = "/ws", **headers: str) -> Any:
    base = {
        "host": "x",
        "upgrade": "websocket",
        "connection": "Upgrade",
        "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ==",
        "sec-websocket-version": "13",
    }
    base.update({k.replace("_", "-"): v for k, v in headers.items()})
    return check_client_request(
        h11.Request(method="GET", target=target, headers=list(base.items()))
    )


def token(claims: dict[str, Any] | None = None, key: Any = SECRET, alg: str = "HS256") -> str:
    body = {"sub": "alice", "exp": int(time.time()) + 60, "aud": "chat"}
    body.update(claims or {})
    return jwt.encode({k: v for k, v in body.items() if v is not None}, key, algorithm=alg)


def hs(**kw: Any) -> Authenticator:
    return Authenticator(AuthCfg(jwt=JwtCfg(secret=SECRET, audience="chat", **kw)))


def bearer(t: str) -> Any:
    return request(authorization=f"Bearer {t}")


def test_valid_token_and_session_claim() -> None:
    auth = hs(session_claim="sub")
    claims = auth.check(bearer(token()))
    assert claims["sub"] == "alice" and auth.session_key(claims) == "alice"


@pytest.mark.parametrize(
    "make",
    [
        lambda: token({"exp": int(time.time()) - 10}),  # expired
        lambda: token({"exp": None}),  # no expiry at all
        lambda: token({"aud": "other"}),  # wrong audience
        lambda: token(key="another-secret-of-sufficient-length!" * 2),  # wrong key
        lambda: token(alg="HS512"),  # an algorithm the config did not pin
        lambda: jwt.encode(
            {"sub": "x", "exp": int(time.time()) + 60, "aud": "chat"}, None, algorithm="none"
        ),
        lambda: "not.a.jwt",
    ],
    ids=["expired", "no-exp", "audience", "key", "alg-not-pinned", "alg-none", "garbage"],
)
def test_bad_tokens_get_401(make: Any) -> None:
    with pytest.raises(HandshakeReject) as exc:
        hs().check(bearer(make()))
    assert exc.value.status == 401
    assert any(k == b"www-authenticate" for k, _ in exc.value.headers)


def test_missing_token_and_query_parameter() -> None:
    with pytest.raises(HandshakeReject) as exc:
        hs().check(request())
    assert exc.value.status == 401
    assert hs(query_param="access_token").check(request(f"/ws?access_token={token()}"))
    with pytest.raises(HandshakeReject):
        hs().check(request(f"/ws?access_token={token()}"))  # not configured: not accepted


def test_rs256_public_key_and_the_hs256_confusion_attack(tmp_path: Path) -> None:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    pub = tmp_path / "pub.pem"
    pub.write_bytes(pem)
    auth = Authenticator(AuthCfg(jwt=JwtCfg(public_key_file=str(pub), algorithms=("RS256",))))
    good = jwt.encode({"sub": "bob", "exp": int(time.time()) + 60}, key, algorithm="RS256")
    assert auth.check(bearer(good))["sub"] == "bob"
    # A token signed HS256 (e.g. with the public key as the secret) is refused: RS256 is pinned.
    with pytest.raises(HandshakeReject):
        auth.check(bearer(token(alg="HS256")))


def test_origins() -> None:
    auth = Authenticator(AuthCfg(origins=("https://app.example",)))
    assert auth.check(request(origin="https://APP.example:443")) == {}
    for bad in ("https://evil.example", "http://app.example"):
        with pytest.raises(HandshakeReject) as exc:
            auth.check(request(origin=bad))
        assert exc.value.status == 403
    with pytest.raises(HandshakeReject):
        auth.check(request())
    assert normalise_origin("HTTP://Host:80") == "http://host"


async def test_jwt_end_to_end_no_worker_connection_on_refusal(tmp_path: Path) -> None:
    w = Worker("jw").start()
    cfg = pool_config([{"id": "jw", "url": w.url}])
    cfg["auth"] = {
        "jwt": {
            "secret": SECRET,
            "algorithms": ["HS256"],
            "audience": "chat",
            "query_param": "access_token",
            "session_claim": "sub",
        }
    }
    lb = Wslb(cfg, tmp_path).start()
    try:
        before = w.metrics()
        for headers in ({}, {"Authorization": f"Bearer {token({'exp': 1})}"}):
            c = await RawClient.connect(lb.port, headers=headers)
            assert c.status == 401
        with pytest.raises(InvalidStatus):
            async with connect(f"{lb.url}/ws", additional_headers={"Authorization": "Bearer x"}):
                pass
        assert _connections(w.metrics()) == _connections(before)  # the worker saw nothing
        async with connect(f"{lb.url}/ws?access_token={token({'sub': 'carol'})}") as ws:
            hello = json.loads(await ws.recv())
            assert hello["session"] == "carol"  # the claim is the session key
        assert 'wslb_handshake_rejections_total{status="401"} 3.0' in lb.admin("/metrics")
    finally:
        lb.stop()
        w.stop()


def _connections(metrics: str) -> float:
    for line in metrics.splitlines():
        if line.startswith("wslb_worker_connections_total"):
            return float(line.split()[-1])
    raise AssertionError("wslb_worker_connections_total missing")

"""TLS: wss:// termination on a listener (with reload on SIGHUP) and wss:// to workers (mTLS)."""

from __future__ import annotations

import asyncio
import signal
import ssl
from pathlib import Path

import pytest
import trustme
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve

from tests.procs import Wslb, free_port, pool_config


async def echo(ws: ServerConnection) -> None:
    async for msg in ws:
        await ws.send(msg)


def client_ctx(ca: trustme.CA) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    return ctx


async def test_wss_both_ways_with_client_certificate_and_reload(tmp_path: Path) -> None:
    edge_ca, worker_ca, client_ca = trustme.CA(), trustme.CA(), trustme.CA()
    # The worker: wss, requires a client certificate signed by client_ca.
    wctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    worker_ca.issue_cert("127.0.0.1").configure_cert(wctx)
    client_ca.configure_trust(wctx)
    wctx.verify_mode = ssl.CERT_REQUIRED
    wport = free_port()
    # wslb's files.
    edge_cert = tmp_path / "edge.pem"
    edge_ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(edge_cert))
    worker_ca.cert_pem.write_to_path(str(tmp_path / "worker-ca.pem"))
    mine = client_ca.issue_cert("wslb")
    mine.cert_chain_pems[0].write_to_path(str(tmp_path / "client.crt"))
    mine.private_key_pem.write_to_path(str(tmp_path / "client.key"))
    port = free_port()
    cfg = pool_config(
        [{"id": "tls", "url": f"wss://127.0.0.1:{wport}/"}],
        health={"enabled": False},
        upstream_tls={
            "ca": str(tmp_path / "worker-ca.pem"),
            "cert": str(tmp_path / "client.crt"),
            "key": str(tmp_path / "client.key"),
        },
    )
    cfg["listen"] = [
        {"address": f"127.0.0.1:{port}", "tls": {"cert": str(edge_cert), "key": str(edge_cert)}}
    ]
    lb = Wslb(cfg, tmp_path)
    lb.port = port
    async with serve(echo, "127.0.0.1", wport, ssl=wctx):
        lb.start(wait_ready=False)
        try:
            url = f"wss://127.0.0.1:{port}/ws"
            async with connect(url, ssl=client_ctx(edge_ca)) as ws:
                await ws.send("over tls twice")
                assert await ws.recv() == "over tls twice"
            # A client that does not trust the edge CA is refused by TLS itself.
            with pytest.raises(ssl.SSLCertVerificationError):
                async with connect(url, ssl=client_ctx(worker_ca)):
                    pass
            # New certificate from another CA, SIGHUP: new handshakes get it.
            new_ca = trustme.CA()
            new_ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(
                str(edge_cert)
            )
            assert lb.proc is not None
            lb.proc.send_signal(signal.SIGHUP)
            for _ in range(50):
                try:
                    async with connect(url, ssl=client_ctx(new_ca)) as ws:
                        await ws.send("renewed")
                        assert await ws.recv() == "renewed"
                        break
                except ssl.SSLCertVerificationError:
                    await asyncio.sleep(0.1)
            else:
                raise AssertionError("certificate was not reloaded")
        finally:
            lb.stop()


async def test_worker_with_untrusted_certificate_gives_502(tmp_path: Path) -> None:
    wctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    trustme.CA().issue_cert("127.0.0.1").configure_cert(wctx)
    wport = free_port()
    other = trustme.CA()
    other.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    cfg = pool_config(
        [{"id": "tls", "url": f"wss://127.0.0.1:{wport}/"}],
        health={"enabled": False},
        upstream_tls={"ca": str(tmp_path / "ca.pem")},
    )
    lb = Wslb(cfg, tmp_path)
    async with serve(echo, "127.0.0.1", wport, ssl=wctx):
        lb.start(wait_ready=False)
        try:
            from websockets.exceptions import InvalidStatus

            with pytest.raises(InvalidStatus) as exc:
                async with connect(f"{lb.url}/ws"):
                    pass
            assert exc.value.response.status_code == 502
        finally:
            lb.stop()


async def test_failed_handshakes_are_logged_and_counted(tmp_path: Path) -> None:
    """Each failed TLS handshake leaves a log line with the client and OpenSSL's reason, and
    ``wslb_tls_handshake_failures_total{reason}``: plain HTTP to the TLS port and a client that
    does not trust the certificate (curl: its alert names the reason), a TCP connect that sends
    nothing until the handshake timeout. A good client is served meanwhile. A connection closed
    without a word (a TCP health check) is counted, not logged at info."""
    ca = trustme.CA(key_type=trustme.KeyType.ECDSA)
    cert = tmp_path / "edge.pem"
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(cert))
    wport, port = free_port(), free_port()
    cfg = pool_config([{"id": "e", "url": f"ws://127.0.0.1:{wport}/"}], health={"enabled": False})
    cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": {"cert": str(cert), "key": str(cert)}}]
    cfg["timeouts"] = {"handshake": "1s"}
    lb = Wslb(cfg, tmp_path)
    lb.port = port
    async with serve(echo, "127.0.0.1", wport):
        lb.start(wait_ready=False)
        try:
            plain = await asyncio.create_subprocess_exec(
                "curl", "-s", "-o", "/dev/null", "--max-time", "5", f"http://127.0.0.1:{port}/ws"
            )
            await plain.wait()
            untrusting = await asyncio.create_subprocess_exec(
                "curl", "-s", "-o", "/dev/null", "--max-time", "5", f"https://127.0.0.1:{port}/ws"
            )
            assert await untrusting.wait() != 0  # curl says why: it does not trust the CA
            _, silent = await asyncio.open_connection("127.0.0.1", port)
            async with connect(f"wss://127.0.0.1:{port}/ws", ssl=client_ctx(ca)) as ws:
                await ws.send("still served")
                assert await ws.recv() == "still served"
            for _ in range(60):  # the silent one times out after 1 s
                text = lb.output()
                if "failed: timeout" in text:
                    break
                await asyncio.sleep(0.1)
            silent.close()
            text = lb.output()
            assert "TLS handshake from 127.0.0.1 failed: http_request" in text, text
            assert "TLS handshake from 127.0.0.1 failed: tlsv1_alert_unknown_ca" in text, text
            assert "TLS handshake from 127.0.0.1 failed: timeout" in text, text
            assert "failed: closed" not in text and "failed: reset" not in text, text
            metrics = lb.admin("/metrics")
            for reason in ("http_request", "tlsv1_alert_unknown_ca", "timeout"):
                line = f'wslb_tls_handshake_failures_total{{reason="{reason}"}} 1.0'
                assert line in metrics, metrics
        finally:
            lb.stop()

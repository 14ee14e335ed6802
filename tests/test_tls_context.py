"""The one TLS context of a process's per-call httpx clients (`lightning.serving.tls_context`): built once, and as
strict as httpx's own default (a shared context must not weaken the check of an https URL)."""

from __future__ import annotations

import ssl

from lightning.serving import tls_context


def test_one_tls_context_serves_every_per_call_client_and_still_verifies() -> None:
    context = tls_context()
    assert tls_context() is context  # built once: each build loads the CA bundle (20 ms of CPU)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert context.cert_store_stats()["x509_ca"] > 0  # the CA bundle is loaded: https servers are verified

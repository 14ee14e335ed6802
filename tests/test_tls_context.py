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


def test_prefect_s_api_clients_share_one_verifying_context_and_its_insecure_one_stays_their_own() -> None:
    import prefect.client.orchestration as clients
    from prefect.settings import PREFECT_API_TLS_INSECURE_SKIP_VERIFY, PREFECT_API_URL, temporary_settings

    from tasks.prefect_clients import share_tls_contexts

    def contexts(count: int) -> list[ssl.SSLContext]:
        made = [clients.get_client(sync_client=True) for _ in range(count)]
        return [client._client._transport._pool._ssl_context for client in made]

    assert share_tls_contexts()  # (importing `tasks` did it already: a second call changes nothing)
    with temporary_settings({PREFECT_API_URL: "https://127.0.0.1:9/api"}):
        first, second = contexts(2)
        assert first is second  # one CA bundle loaded for every client, not one for each
        assert first.verify_mode == ssl.CERT_REQUIRED and first.check_hostname
        assert first.cert_store_stats()["x509_ca"] > 0
    with temporary_settings({PREFECT_API_URL: "https://127.0.0.1:9/api", PREFECT_API_TLS_INSECURE_SKIP_VERIFY: True}):
        insecure, other = contexts(2)
        assert insecure is not other and insecure.verify_mode == ssl.CERT_NONE  # Prefect changes it: never shared
    with temporary_settings({PREFECT_API_URL: "https://127.0.0.1:9/api"}):
        assert contexts(1)[0] is first and first.verify_mode == ssl.CERT_REQUIRED  # the shared one never weakened

"""``redact_url``: no secret of a proxy URL reaches a log line, in any userinfo form."""

from __future__ import annotations

import pytest

from cdc.settings.values import redact_url


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://KEY@proxy:3128", "http://***@proxy:3128"),  # user only: an API key
        ("http://user:s3cret@proxy:3128", "http://user:***@proxy:3128"),
        ("http://:s3cret@proxy:3128", "http://:***@proxy:3128"),
        ("https://sk_live_9f8e%40x@proxy.example:8443/path", "https://***@proxy.example:8443/path"),
        ("http://proxy:3128", "http://proxy:3128"),
        ("http://@proxy:3128", "http://@proxy:3128"),
        ("", ""),
    ],
)
def test_redact_url_hides_the_password_or_a_user_only_userinfo(url: str, expected: str) -> None:
    assert redact_url(url) == expected


@pytest.mark.parametrize("secret", ["KEY", "s3cret", "sk_live_9f8e"])
def test_no_form_of_userinfo_leaks_its_secret(secret: str) -> None:
    for url in (
        f"http://{secret}@proxy:3128",
        f"http://u:{secret}@proxy:3128",
        f"socks5h://u:{secret}@proxy:1080",
        f"socks5h://{secret}@proxy:1080",
    ):
        assert secret not in redact_url(url)

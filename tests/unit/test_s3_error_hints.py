"""What an object-store error tells the user to check (ckptd.storage.s3client.S3Client._error): a
refusal of the credentials only when the store said so, never because a duration or a port in the
message happens to contain the digits 403 (a full store's 500 was once reported as a credentials
problem: "... in 1.394114031s, after 6 retries ... 500")."""

from __future__ import annotations

import pytest

from ckptd.storage.s3client import S3Client
from ckptd.storage.url import S3Location

CREDENTIALS = "check the credentials"
HEALTH = "the store's health"


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> S3Client:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test-key-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test-secret")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    return S3Client(S3Location(bucket="b", prefix="p"))


@pytest.mark.parametrize(
    ("text", "hint"),
    [
        (
            "Generic S3 error: Error performing PUT http://127.0.0.1:26807/full/run/x in 1.394114031s, after 6 "
            "retries, max_retries: 6 - Server returned non-2xx status code: 500 Internal Server Error",
            HEALTH,
        ),
        ("Error performing GET http://10.0.0.1:4031/b/k - Server returned non-2xx status code: 503", HEALTH),
        ("Server returned non-2xx status code: 403 Forbidden", CREDENTIALS),
        # 403 in the URL (rank 403's data object, a part number), the store answering 503
        (
            "Error performing PUT http://10.0.0.1:9000/b/run-403/iter_0000001/__403_0.abc-1.distcp?partNumber=403 "
            "- Server returned non-2xx status code: 503 Service Unavailable",
            HEALTH,
        ),
        ("An error occurred (403) when calling the HeadObject operation: Forbidden", CREDENTIALS),
        ("<Code>SignatureDoesNotMatch</Code>", CREDENTIALS),
        ("An error occurred (AccessDenied) when calling the PutObject operation", CREDENTIALS),
    ],
)
def test_the_hint_follows_what_the_store_said(client: S3Client, text: str, hint: str) -> None:
    assert hint in str(client._error(OSError(text), "k", "upload"))


# obstore's text of an answer with an XML body: the body on the lines after the first, then a dump.
_ANSWERED = (
    "Generic S3 error: Error performing list request: Error performing GET http://127.0.0.1:9/b?list-type=2 "
    'in 3.5ms - Server returned non-2xx status code: {status}: <?xml version="1.0" encoding="UTF-8"?>\n'
    "<Error><Code>{code}</Code><Message>...</Message><RequestId>X</RequestId></Error>\n\nDebug source:\n"
    'Generic {{\n    store: "S3",\n    source: ListRequest {{\n        uri: Some(http://127.0.0.1:9/b),\n'
)


@pytest.mark.parametrize(
    ("status", "code", "hint"),
    [
        ("404 Not Found", "NoSuchBucket", "create the bucket 'b' first"),
        ("403 Forbidden", "AccessDenied", CREDENTIALS),
        ("400 Bad Request", "InvalidAccessKeyId", CREDENTIALS),
        ("503 Service Unavailable", "SlowDown", HEALTH),
    ],
)
def test_the_stores_error_code_counts_where_it_stands_in_the_text(client: S3Client, status, code, hint):
    """obstore puts the answer's body, and with it the error code, past the first line of its text,
    which alone was read: a missing bucket was reported as a network problem."""
    message = str(client._error(OSError(_ANSWERED.format(status=status, code=code)), "k", "list"))
    assert hint in message and f"({code})" in message and "Debug source" not in message

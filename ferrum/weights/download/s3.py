"""`S3Object`: a `RemoteObject` over boto3, its blocking calls run in threads (`asyncio.to_thread`).

- The client uses the source's region and endpoint when it has them, else boto3's standard chain
  (AWS_REGION / AWS_DEFAULT_REGION, AWS_ENDPOINT_URL(_S3), ~/.aws/config, credentials from the env,
  profile, role, ...). boto3's own retries are off: `retrying` does them, with `config.max_retries`;
  connect and read time-outs are `config.timeout_s` (for each wait for data, as for HTTP).
- `info()`: HeadObject with ChecksumMode=ENABLED. `sha256` is the object's ChecksumSHA256 (base64
  -> hex) when it is a full-object checksum (a multipart upload's composite checksum, "...-N", is a
  checksum of part checksums: not used); `md5` is the ETag when it is a plain MD5 (no '-', so not
  multipart, and not SSE-KMS / SSE-C encrypted, whose ETags are not MD5s).
- `read_range`: ranged GetObject with IfMatch on the ETag `info()` saw, so an object replaced mid-
  download fails with `IntegrityError` instead of mixing two versions.
- Errors: NoSuchKey / NoSuchBucket / 404 -> `SourceNotFoundError`; 403 and credential problems ->
  `WeightError` saying to check the credentials; 5xx, SlowDown, throttling, time-outs and connection
  failures -> `SourceUnavailableError` (retried, honouring Retry-After); anything else -> `WeightError`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import os
import re
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import boto3
import botocore.config
import botocore.exceptions

from ferrum.weights.download.cache import make_cache_key
from ferrum.weights.download.remote import (
    ObjectInfo,
    RetryPolicy,
    parse_retry_after,
    read_range_resuming,
    retrying,
)
from ferrum.weights.errors import IntegrityError, SourceNotFoundError, SourceUnavailableError, WeightError

if TYPE_CHECKING:
    from ferrum.weights.spec.loader_config import WeightLoaderConfig
    from ferrum.weights.spec.sources import S3

__all__ = ["S3Object"]

T = TypeVar("T")

# StreamingBody.read(n) waits for all n bytes: a cut or time-out loses up to this much of a range.
_READ_PIECE = 32 * 1024
_PLAIN_MD5 = re.compile(r"[0-9a-f]{32}")
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")
_NOT_FOUND = frozenset({"NoSuchKey", "NoSuchBucket", "NotFound", "404"})
_DENIED = frozenset({
    "AccessDenied", "Forbidden", "403", "401", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
    "InvalidToken", "TokenRefreshRequired", "AllAccessDisabled", "AccountProblem",
})
_TRANSIENT = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
    "RequestThrottled", "ServiceUnavailable", "InternalError", "RequestTimeout", "RequestTimeoutException",
    "PriorRequestNotComplete", "503", "500", "429",
})
_CHANGED = frozenset({"PreconditionFailed", "412"})
_CREDENTIALS = (
    botocore.exceptions.NoCredentialsError,
    botocore.exceptions.PartialCredentialsError,
    botocore.exceptions.CredentialRetrievalError,
)
_TRANSPORT = (
    botocore.exceptions.ConnectionError,
    botocore.exceptions.HTTPClientError,
    botocore.exceptions.IncompleteReadError,
)
_TIMEOUTS = (botocore.exceptions.ReadTimeoutError, botocore.exceptions.ConnectTimeoutError)


# what boto3's chain reads from the environment: a client is shared only while these stay the same
_CHAIN_ENV = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE",
    "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3", "AWS_CA_BUNDLE", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN",
)


def shared_client(region: str | None, endpoint: str | None, timeout_s: float, pool: int) -> Any:
    """One boto3 client per region, endpoint, settings and credential environment in this process
    (clients are thread-safe; making one costs tens of milliseconds, and a model's files, shards
    and its publication would each make their own). Refreshable credentials (instance roles, SSO)
    refresh themselves inside the client."""
    return _client_for(region, endpoint, timeout_s, pool, tuple(os.environ.get(k) for k in _CHAIN_ENV))


@functools.lru_cache(maxsize=16)
def _client_for(
    region: str | None, endpoint: str | None, timeout_s: float, pool: int, _env: tuple[str | None, ...]
) -> Any:
    return boto3.session.Session().client(
        "s3",
        region_name=region,
        endpoint_url=endpoint,
        config=botocore.config.Config(
            connect_timeout=timeout_s,
            read_timeout=timeout_s,
            retries={"total_max_attempts": 1},
            max_pool_connections=pool,
        ),
    )


class S3Object:
    """The object `source` (an `S3` source: bucket, key, optional region and endpoint). A boto3
    client may be passed in (shared between objects); otherwise one is made on first use."""

    def __init__(
        self,
        source: S3,
        config: WeightLoaderConfig,
        *,
        client: Any | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.source = source
        self.bucket = source.bucket
        self.key = source.key
        self.name = source.display
        self.cache_key = make_cache_key(
            "s3", source.filename, f"{source.endpoint or ''}|{source.bucket}/{source.key}"
        )
        self._config = config
        self._retry = retry or RetryPolicy.from_config(config)
        self._client = client
        self._client_lock = threading.Lock()
        self._etag: str | None = None
        self._size: int | None = None

    def __repr__(self) -> str:
        return f"S3Object({self.name!r})"

    # -- RemoteObject ------------------------------------------------------------------------------

    async def info(self) -> ObjectInfo:
        response = await retrying(self.name, self._retry, lambda: self._call("HeadObject", self._head), "HeadObject")
        info = _object_info(response)
        self._etag, self._size = info.etag, info.size
        return info

    async def read_range(self, start: int, end: int) -> bytes:
        if self._size is not None and end > self._size:
            raise ValueError(f"{self.name}: byte range [{start}, {end}) is past the end ({self._size} bytes)")

        async def read_into(buf: bytearray) -> None:
            await self._call("GetObject", lambda: self._get_into(start, end, buf))

        return await read_range_resuming(self.name, self._retry, start, end, read_into)

    async def aclose(self) -> None:
        """Nothing to release (boto3 clients need no closing); here for symmetry with HttpObject."""

    # -- boto3 calls (in threads) ------------------------------------------------------------------

    def client(self) -> Any:
        with self._client_lock:
            if self._client is None:
                self._client = shared_client(
                    self.source.region, self.source.endpoint, self._config.timeout_s,
                    max(10, self._config.max_concurrent_downloads + 2),
                )
            return self._client

    def _head(self) -> dict[str, Any]:
        response: dict[str, Any] = self.client().head_object(
            Bucket=self.bucket, Key=self.key, ChecksumMode="ENABLED"
        )
        return response

    def _get_into(self, start: int, end: int, buf: bytearray) -> None:
        pos = start + len(buf)
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self.key, "Range": f"bytes={pos}-{end - 1}"}
        if self._etag is not None:
            kwargs["IfMatch"] = self._etag
        response = self.client().get_object(**kwargs)
        body = response["Body"]
        try:
            match = _CONTENT_RANGE.match(response.get("ContentRange") or "")
            if match is None or int(match.group(1)) != pos:
                raise WeightError(
                    self.name,
                    f"asked for bytes {pos}-{end - 1}, got Content-Range {response.get('ContentRange')!r}",
                )
            if self._size is not None and int(match.group(3)) != self._size:
                raise IntegrityError(
                    self.name, f"the object changed while being read: size {match.group(3)}, was {self._size}"
                )
            want = end - start
            while len(buf) < want:
                piece = body.read(min(_READ_PIECE, want - len(buf)))
                if not piece:
                    return
                buf += piece
        finally:
            body.close()

    async def _call(self, operation: str, fn: Callable[[], T]) -> T:
        """`fn()` in a thread, its boto3 / botocore errors turned into weights errors."""
        try:
            return await asyncio.to_thread(fn)
        except WeightError:
            raise
        except botocore.exceptions.ClientError as exc:
            raise self._client_error(operation, exc) from exc
        except _CREDENTIALS as exc:
            raise WeightError(
                self.name, f"{operation}: no usable AWS credentials ({exc}): set AWS_ACCESS_KEY_ID / "
                f"AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or give the machine a role"
            ) from exc
        except _TIMEOUTS as exc:
            raise SourceUnavailableError(
                self.name, f"{operation} timed out: no data for {self._config.timeout_s:g} s"
            ) from exc
        except (*_TRANSPORT, OSError) as exc:
            raise SourceUnavailableError(self.name, f"{operation} failed: {exc}") from exc
        except botocore.exceptions.BotoCoreError as exc:
            raise WeightError(self.name, f"{operation} failed: {exc}") from exc

    def _client_error(self, operation: str, exc: botocore.exceptions.ClientError) -> WeightError:
        error = exc.response.get("Error", {})
        meta = exc.response.get("ResponseMetadata", {})
        code = str(error.get("Code", ""))
        status = int(meta.get("HTTPStatusCode", 0) or 0)
        detail = f"{operation}: {code or 'error'} (HTTP {status})"
        if error.get("Message"):
            detail += f": {error['Message']}"
        if code in _NOT_FOUND or status == 404:
            what = {"NoSuchBucket": "no such bucket", "NoSuchKey": "no such key"}.get(code, "no such bucket or key")
            return SourceNotFoundError(self.name, f"not found ({what}; {detail})")
        if code in _DENIED or status in (401, 403):
            return WeightError(
                self.name,
                f"access denied ({detail}): check the AWS credentials (AWS_ACCESS_KEY_ID / AWS_PROFILE / role) "
                f"and that they may read this bucket and key",
            )
        if code in _CHANGED or status == 412:
            return IntegrityError(
                self.name, f"the object changed while being downloaded (ETag is no longer {self._etag}): {detail}"
            )
        if code in _TRANSIENT or status >= 500 or status in (408, 429):
            headers = meta.get("HTTPHeaders", {})
            return SourceUnavailableError(self.name, detail, retry_after=parse_retry_after(headers.get("retry-after")))
        return WeightError(self.name, detail)


def _object_info(response: dict[str, Any]) -> ObjectInfo:
    etag = response.get("ETag")
    plain = etag.strip('"').lower() if etag else None
    encrypted = response.get("ServerSideEncryption") in ("aws:kms", "aws:kms:dsse") or bool(
        response.get("SSECustomerAlgorithm")
    )
    md5 = plain if plain is not None and _PLAIN_MD5.fullmatch(plain) and not encrypted else None
    last_modified = response.get("LastModified")
    return ObjectInfo(
        size=int(response["ContentLength"]),
        sha256=_full_object_sha256(response.get("ChecksumSHA256"), response.get("ChecksumType")),
        md5=md5,
        etag=etag,
        accepts_ranges=True,
        last_modified=last_modified.isoformat() if last_modified is not None else None,
    )


def _full_object_sha256(checksum: str | None, checksum_type: str | None) -> str | None:
    """Hex of a base64 ChecksumSHA256 when it is the whole object's (not a multipart composite)."""
    if not checksum or "-" in checksum or checksum_type not in (None, "FULL_OBJECT"):
        return None
    try:
        raw = base64.b64decode(checksum, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw.hex() if len(raw) == 32 else None

"""A lean S3 ``GetObject`` for the read hot path: SigV4 in microseconds, one plain GET.

Through s3fs and aiobotocore, one small GET costs about 2 ms of CPU on this
machine (user-agent assembly, event hooks, endpoint rules, response parsing with
dateutil, checksum context...), which on a 2-core box caps reading at a few hundred
objects per second per core before any decoding.  Here botocore is asked once per
bucket where objects live (a presigned URL gives the host and path layout it
would use, addressing style and region included) and for the credentials; each
read then signs its request with AWS Signature Version 4 (a SHA-256 and an HMAC)
and sends it with the lean client of :mod:`asyncfeed._io.http11`.

Only plain reads take this path: no requester-pays, SSE-C, version ids or other
extra request arguments, no custom TLS verification or proxy (explicit or from the
environment); ``FsspecSource`` falls back to s3fs for those.  An
answer that says the request was addressed or signed wrongly (a redirect to
another region, a malformed authorization) turns the fast path off for that
bucket and the read goes through s3fs.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
import time
from typing import Any
from urllib.parse import quote, urlsplit

__all__ = ["S3FastReader", "S3StatusError"]

_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_CODE = re.compile(rb"<Code>([^<]{1,100})</Code>")
_MESSAGE = re.compile(rb"<Message>([^<]{0,300})</Message>")
_WRONG_ADDRESS = frozenset({"PermanentRedirect", "AuthorizationHeaderMalformed",
                            "TemporaryRedirect", "IllegalLocationConstraintException",
                            "InvalidRequest", "SignatureDoesNotMatch"})
_CREDENTIALS_TTL = 30.0  # seconds between asking botocore for (possibly refreshed) keys


class S3StatusError(OSError):
    """S3 answered an error status.  ``response`` mirrors botocore's ``ClientError``."""

    def __init__(self, status: int, code: str | None, message: str, url: str,
                 retry_after: float | None = None) -> None:
        super().__init__(f"HTTP {status} {code or ''}: {message}".strip())
        self.response = {"Error": {"Code": code, "Message": message},
                         "ResponseMetadata": {"HTTPStatusCode": status}}
        self.url = url
        self.retry_after = retry_after


class _FallBack(Exception):
    """The fast path cannot serve this bucket; use s3fs."""


def _quote_key(key: str) -> str:
    return quote(key, safe="/-_.~")


class _Bucket:
    __slots__ = ("prefix", "host", "path_prefix", "region")

    def __init__(self, presigned: str, quoted_key: str, region: str) -> None:
        base = presigned.split("?", 1)[0]
        if not base.endswith(quoted_key):
            raise _FallBack(f"unexpected presigned URL layout: {base}")
        self.prefix = base[: len(base) - len(quoted_key)]      # scheme://host[:port]/[bucket/]
        parts = urlsplit(self.prefix)
        self.host = parts.netloc
        self.path_prefix = parts.path                          # "/" or "/bucket/"
        self.region = region


class S3FastReader:
    """Signed GETs of S3 objects through ``pool`` (an :class:`asyncfeed._io.http11.HTTPPool`
    of the running loop).

    Build with :meth:`create`, which returns None when the filesystem's settings
    need s3fs (then every read should go through s3fs).
    """

    def __init__(self, fs: Any, pool: Any, unsigned: bool) -> None:
        self._fs = fs
        self._pool = pool
        self._unsigned = unsigned
        self._buckets: dict[str, _Bucket | None] = {}
        self._probing: dict[str, asyncio.Future] = {}
        self._creds: tuple[str, str, str | None] | None = None
        self._creds_at = 0.0
        self._keys: dict[tuple[str, str, str], bytes] = {}
        self._stamp_second = -1
        self._stamp = ("", "")

    @classmethod
    async def create(cls, fs: Any, pool: Any) -> "S3FastReader | None":
        """A reader for the s3fs filesystem ``fs`` (its session set), or None if unsuitable."""
        if getattr(fs, "version_aware", False) or getattr(fs, "req_kw", None) \
                or getattr(fs, "s3_additional_kwargs", None):
            return None
        client_kwargs = getattr(fs, "client_kwargs", None) or {}
        config_kwargs = getattr(fs, "config_kwargs", None) or {}
        if client_kwargs.get("verify") is not None or "proxies" in config_kwargs \
                or "client_cert" in config_kwargs:
            return None  # TLS or proxy settings only botocore knows how to honour
        import urllib.request
        proxies = urllib.request.getproxies()
        if proxies.get("https") or proxies.get("http") or proxies.get("all"):
            return None  # botocore goes through the environment's proxy; so must we
        await fs.set_session()
        client = fs._s3
        signer = getattr(client, "_request_signer", None)
        if signer is None:
            return None
        version = getattr(signer, "_signature_version", None)
        unsigned = not isinstance(version, str)  # botocore.UNSIGNED (anon=True)
        if not unsigned and version not in ("s3v4", "v4"):
            return None
        return cls(fs, pool, unsigned)

    # -- per bucket: where objects live -------------------------------------------------
    async def _bucket(self, bucket: str) -> _Bucket | None:
        if bucket in self._buckets:
            return self._buckets[bucket]
        task = self._probing.get(bucket)
        if task is None or (task.done() and (task.cancelled() or task.exception())):
            task = self._probing[bucket] = asyncio.ensure_future(self._probe(bucket))
        info = await asyncio.shield(task)  # one probe per bucket, whoever times out
        self._buckets[bucket] = info
        self._probing.pop(bucket, None)
        return info

    async def _probe(self, bucket: str) -> _Bucket | None:
        """Ask botocore (once) where the objects of ``bucket`` live."""
        try:
            client = await self._fs.get_s3(bucket)  # a region lookup with cache_regions
            probe = "asyncfeed-probe/k"
            url = await client.generate_presigned_url(
                "get_object", Params={"Bucket": bucket, "Key": probe}, ExpiresIn=60)
            return _Bucket(url, _quote_key(probe), client.meta.region_name)
        except _FallBack:
            return None

    async def _credentials(self) -> tuple[str, str, str | None]:
        now = time.monotonic()
        if self._creds is None or now - self._creds_at > _CREDENTIALS_TTL:
            creds = self._fs._s3._request_signer._credentials
            if creds is None:
                raise _FallBack("no credentials")
            frozen = await creds.get_frozen_credentials()
            self._creds = (frozen.access_key, frozen.secret_key, frozen.token)
            self._creds_at = now
        return self._creds

    def _timestamps(self) -> tuple[str, str]:
        now = int(time.time())
        if now != self._stamp_second:
            t = time.gmtime(now)
            self._stamp = (time.strftime("%Y%m%dT%H%M%SZ", t), time.strftime("%Y%m%d", t))
            self._stamp_second = now
        return self._stamp

    def _signing_key(self, secret: str, day: str, region: str) -> bytes:
        k = self._keys.get((secret, day, region))
        if k is None:
            k = hmac.new(("AWS4" + secret).encode(), day.encode(), hashlib.sha256).digest()
            for part in (region, "s3", "aws4_request"):
                k = hmac.new(k, part.encode(), hashlib.sha256).digest()
            if len(self._keys) > 16:
                self._keys.clear()
            self._keys[(secret, day, region)] = k
        return k

    async def _headers(self, b: _Bucket, canonical_uri: str,
                       range_header: str | None) -> dict[str, str]:
        headers = {"Host": b.host}
        if range_header is not None:
            headers["Range"] = range_header
        if self._unsigned:
            return headers
        access, secret, token = await self._credentials()
        amzdate, day = self._timestamps()
        signed = [("host", b.host), ("x-amz-content-sha256", _EMPTY_SHA256),
                  ("x-amz-date", amzdate)]
        if token:
            signed.append(("x-amz-security-token", token))
        names = ";".join(n for n, _ in signed)
        canonical = "\n".join(("GET", canonical_uri, "",
                               "".join(f"{n}:{v}\n" for n, v in signed), names, _EMPTY_SHA256))
        scope = f"{day}/{b.region}/s3/aws4_request"
        to_sign = "\n".join(("AWS4-HMAC-SHA256", amzdate, scope,
                             hashlib.sha256(canonical.encode()).hexdigest()))
        signature = hmac.new(self._signing_key(secret, day, b.region), to_sign.encode(),
                             hashlib.sha256).hexdigest()
        headers["x-amz-content-sha256"] = _EMPTY_SHA256
        headers["x-amz-date"] = amzdate
        if token:
            headers["x-amz-security-token"] = token
        headers["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={access}/{scope}, "
                                    f"SignedHeaders={names}, Signature={signature}")
        return headers

    # -- reads ---------------------------------------------------------------------------
    async def get(self, bucket: str, key: str, start: int | None = None,
                  end: int | None = None) -> bytes | None:
        """The object's bytes (``[start, end)`` if given), or None: use s3fs for this one."""
        b = await self._bucket(bucket)
        if b is None:
            return None
        quoted = _quote_key(key)
        rng = None
        if start is not None or end is not None:
            if start is None or end is None or end <= start:
                return None  # open or negative ranges: let s3fs work them out
            rng = f"bytes={start}-{end - 1}"
        try:
            headers = await self._headers(b, b.path_prefix + quoted, rng)
        except _FallBack:
            self._buckets[bucket] = None
            return None
        url = b.prefix + quoted
        r = await self._pool._once(url, headers, "GET")  # no redirects: a 3xx means fall back
        data, status, retry_after = r.body, r.status, r.headers.get("retry-after")
        if status == 200 or (status == 206 and rng is not None):
            return data
        code_m, msg_m = _CODE.search(data), _MESSAGE.search(data)
        code = code_m.group(1).decode(errors="replace") if code_m else None
        message = msg_m.group(1).decode(errors="replace") if msg_m else data[:200].decode(
            errors="replace")
        if code in _WRONG_ADDRESS or 300 <= status < 400:
            self._buckets[bucket] = None  # region or addressing we did not get right
            return None
        if status == 404 or code in ("NoSuchKey", "NoSuchBucket"):
            raise FileNotFoundError(f"s3://{bucket}/{key}: {code or 'HTTP 404'}: {message}")
        try:
            after = float(retry_after) if retry_after else None
        except ValueError:
            after = None
        raise S3StatusError(status, code, message, url, after)

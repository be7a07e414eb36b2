"""huggingface_hub's exceptions as Ferrum weights errors, each on one line naming the repository, the
file and the revision.

The real Hub answers 401 "repository not found" for a repository that does not exist or that the
token may not read (it does not tell the two apart), 404 for a missing revision or file. Some
mirrors (olah among them) answer 401 "repository not found" for a missing file or revision as well,
so that message says the missing part may be any of the three.
"""

from __future__ import annotations

from huggingface_hub import errors as hf_errors

from ferrum.weights.download.remote import is_transient_status, parse_retry_after
from ferrum.weights.errors import (
    IntegrityError,
    SourceNotFoundError,
    SourceUnavailableError,
    UnsupportedError,
    WeightError,
)
from ferrum.weights.hub.settings import HubSettings

__all__ = ["HubTarget", "hub_error"]


class HubTarget:
    """What a call was after, for messages: a repository, a revision and a file (or None: a snapshot)."""

    def __init__(self, repo_id: str, revision: str | None, filename: str | None = None) -> None:
        self.repo_id = repo_id
        self.revision = revision
        self.filename = filename

    @property
    def where(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        tail = f"/{self.filename}" if self.filename else ""
        return f"hf://{self.repo_id}{rev}{tail}"

    @property
    def what(self) -> str:
        file_part = f"file {self.filename!r} in " if self.filename else ""
        return f"{file_part}repository {self.repo_id!r} at revision {self.revision or 'main'!r}"


def _status(exc: hf_errors.HfHubHTTPError) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def hub_error(exc: BaseException, target: HubTarget, settings: HubSettings) -> WeightError | None:
    """The WeightError for `exc` raised by huggingface_hub, or None when it is not one of its errors."""
    where, what = target.where, target.what
    if isinstance(exc, hf_errors.GatedRepoError):
        return WeightError(
            where,
            f"{what}: the repository is gated; accept its conditions on the Hub and "
            "set HF_TOKEN to a token of an account that did",
        )
    if isinstance(exc, hf_errors.RepositoryNotFoundError):
        return SourceNotFoundError(
            where,
            f"not found: {settings.endpoint} answered 'repository not found' "
            f"(HTTP {_status(exc) or '401/404'}) for {what}; the repository may not exist or may be private "
            "(set HF_TOKEN); some mirrors answer this also when only the file or the revision is missing",
        )
    if isinstance(exc, hf_errors.RevisionNotFoundError):
        return SourceNotFoundError(
            where, f"not found: revision {target.revision!r} does not exist in repository {target.repo_id!r}"
        )
    if isinstance(exc, hf_errors.RemoteEntryNotFoundError):
        return SourceNotFoundError(where, f"not found: no {what}")
    if isinstance(exc, (hf_errors.LocalEntryNotFoundError, hf_errors.OfflineModeIsEnabled)):
        if settings.offline:
            return SourceNotFoundError(
                where,
                f"{what} is not in the Hugging Face cache {settings.cache_dir} and offline mode is on "
                "(HF_HUB_OFFLINE); fetch it once while online (`ferrum pull`)",
            )
        cause = exc.__cause__  # huggingface_hub wraps what its metadata request failed with
        if isinstance(cause, hf_errors.HfHubHTTPError) and _status(cause) is not None:
            mapped = hub_error(cause, target, settings)
            if mapped is not None:
                return mapped
        return SourceUnavailableError(
            where,
            f"cannot reach {settings.endpoint} (after huggingface_hub's retries) and {what} is not in "
            f"the cache {settings.cache_dir}",
        )
    if isinstance(exc, hf_errors.DisabledRepoError):
        return WeightError(where, f"{what}: the repository is disabled on the Hub")
    if isinstance(exc, hf_errors.HfHubHTTPError):
        status = _status(exc)
        if status is not None and is_transient_status(status):
            response = getattr(exc, "response", None)
            retry_after = (
                parse_retry_after(response.headers.get("Retry-After")) if response is not None else None
            )
            return SourceUnavailableError(
                where, f"{settings.endpoint} answered HTTP {status} for {what}", retry_after=retry_after
            )
        if status in (404, 410):
            return SourceNotFoundError(where, f"not found (HTTP {status}): {what}")
        if status in (401, 403):
            return WeightError(where, f"access denied (HTTP {status}) to {what}: check HF_TOKEN")
        return WeightError(where, f"request refused (HTTP {status}) for {what}: {_first_line(exc)}")
    if isinstance(exc, hf_errors.HTTPError):  # transport: connection refused or reset, time-out
        return SourceUnavailableError(
            where,
            f"connection to {settings.endpoint} failed for {what}: {type(exc).__name__}: {_first_line(exc)}",
        )
    if isinstance(exc, hf_errors.HFValidationError):
        return UnsupportedError(
            where, f"not a valid Hugging Face repository id or revision: {_first_line(exc)}"
        )
    if isinstance(exc, OSError) and str(exc).startswith("Consistency check failed"):
        return IntegrityError(where, f"{what}: {_first_line(exc)}")
    if isinstance(exc, OSError):
        return WeightError(
            where, f"cannot store {what} in the Hugging Face cache {settings.cache_dir}: {_first_line(exc)}"
        )
    return None

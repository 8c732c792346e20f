"""Hugging Face Hub access that fails in seconds, with one line, where the libraries would
retry for minutes: without a network a download is retried with back-off (~25 s measured)."""

from __future__ import annotations

import re
from pathlib import Path

from loom.config import ConfigError

HUB_TIMEOUT_S = 5.0
"""Seconds the reachability probe may take before the hub counts as unreachable."""

LOCAL_FILES_HINT = ("pass local files instead: --dataset path/to/data.parquet, "
                    "data.jsonl or a folder of .txt files")

_HUB_ID = re.compile(r"([A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*")


def looks_like_hub_id(name: str, bare_ok: bool = False) -> bool:
    """`owner/name` (or a legacy bare `name` such as `gpt2` where `bare_ok`) that is not a
    path on this machine."""
    match = _HUB_ID.fullmatch(name)
    return (match is not None and (bare_ok or match.group(1) is not None)
            and not Path(name).exists())


def hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def ensure_hub_reachable(repo_id: str, repo_type: str, flag: str, hint: str) -> None:
    """Probe the hub once with a short timeout; offline mode skips the probe (the libraries
    then fail at once unless the repo is in the local cache)."""
    if hub_offline():
        return
    from huggingface_hub import HfApi
    from huggingface_hub.utils import HfHubHTTPError, RepositoryNotFoundError

    try:
        HfApi().repo_info(repo_id, repo_type=repo_type, timeout=HUB_TIMEOUT_S)
    except RepositoryNotFoundError:
        raise ConfigError(f"{flag} {repo_id}: no such {repo_type} on the Hugging Face Hub "
                          "(or it is private: log in with `hf auth login`)") from None
    except HfHubHTTPError:
        return  # the hub answered; the loader reports access problems itself
    except Exception as e:  # any failure to connect means the hub is out of reach
        raise ConfigError(f"{flag} {repo_id}: cannot reach the Hugging Face Hub "
                          f"({type(e).__name__}); {hint}, or set HF_HUB_OFFLINE=1 to use "
                          "a cached copy") from None


def first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"

"""The MODEL argument: a local directory, or a Hugging Face hub id fetched into the hub's own cache.

Owns: telling a path from a hub id, downloading through `huggingface_hub` (its progress bars, cache, `revision`,
`HF_HUB_OFFLINE`, `HF_TOKEN`) only the files ignis reads, and one-line ArtifactErrors for every way that fails.
Does not own: checking what is inside the directory (ignis.artifact, ignis.model.config).
"""

from __future__ import annotations

import re
from pathlib import Path

from ignis.errors import ArtifactError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# What ignis reads from an artifact: configs, weights, tokenizer, chat template, and the drafter beside the weights.
PATTERNS = ["*.json", "*.safetensors", "*.jinja", "drafter/*"]


def resolve(model: str, revision: str | None = None) -> tuple[Path, str | None]:
    """(local directory, served name) for MODEL: a directory as given (name None: its own), or a hub id's snapshot
    (named by the id, as vLLM does). Raises ArtifactError with one line saying what to do."""
    path = Path(model).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ArtifactError(f"--revision {revision!r} applies to a Hugging Face id, and {model!r} is a directory")
        return path, None
    if path.exists():
        raise ArtifactError(f"{model!r} is a file; give the checkpoint's directory or a Hugging Face id")
    if not is_hub_id(model):
        raise ArtifactError(f"{model!r}: no such directory; give a checkpoint directory or a Hugging Face id "
                            "such as Qwen/Qwen3.5-27B")
    return download(model, revision), model


def is_hub_id(model: str) -> bool:
    return HUB_ID.fullmatch(model) is not None and not model.startswith((".", "~"))


def download(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot of `repo_id` at `revision`, downloaded (or found in the cache when offline)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise ArtifactError(f"{repo_id!r} looks like a Hugging Face id, which needs huggingface_hub: "
                            "pip install huggingface_hub") from None
    at = f" at revision {revision!r}" if revision else ""
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=PATTERNS))
    except GatedRepoError:
        raise ArtifactError(f"{repo_id!r} is gated on the Hugging Face hub: accept its terms on the model page and "
                            "log in (hf auth login, or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ArtifactError(f"{repo_id!r} is neither a directory here nor a model on the Hugging Face hub (a private "
                            "one needs hf auth login, or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ArtifactError(f"{repo_id!r} has no revision {revision!r} on the Hugging Face hub") from None
    except LocalEntryNotFoundError:
        raise ArtifactError(f"{repo_id!r}{at} is not a directory here, nor in the Hugging Face cache, and the hub "
                            "cannot be reached (offline, or HF_HUB_OFFLINE=1); download it once online, or give a "
                            "directory") from None
    except (HfHubHTTPError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ArtifactError(f"could not fetch {repo_id!r}{at} from the Hugging Face hub: {first}") from None

"""The Hugging Face hub, asked once before a run loads anything that names a hub model or data set.

The libraries ask the hub about every file of a hub name, cached or not, and retry a connection that
fails: an offline run of ``gsm8k`` waited 90 s (the retries went to ``RUN/run.log``), then printed the
hub's own sentence naming neither the model nor the data set nor the ways out. So a run whose config
names hub repos (``unirl.preflight`` lists them, with whether each is in the local cache) first asks
the hub's endpoint once, with a short timeout:

- reachable: nothing changes;
- not reachable and every name cached: the run goes on from the cache with ``HF_HUB_OFFLINE=1`` (one
  line says so), so no library waits on the network;
- not reachable and a name not cached: one error naming each missing repo and the ways out.

Nothing is asked when ``HF_HUB_OFFLINE`` is set already (the libraries then read the cache alone).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

#: Seconds the endpoint has to answer: it answers in well under a second where it is reachable.
TIMEOUT_S = 5.0


@dataclass(frozen=True)
class HubName:
    """A hub repo a config names: the setting (``model.name_or_path``, ``data.train`` ...), the repo, its type."""
    what: str
    repo_id: str
    repo_type: str  # "model" or "dataset"
    cached: bool


def look_up(what: str, repo_id: str, repo_type: str) -> tuple[HubName, Path | None, list[Path]]:
    """``(the name, its cached copy or None, the places looked in)``: the hub cache's snapshots, and for a data
    set the prepared copies ``datasets`` keeps apart (``HF_DATASETS_CACHE``)."""
    from huggingface_hub import constants

    caches = [Path(constants.HF_HUB_CACHE) / f"{repo_type}s--{repo_id.replace('/', '--')}" / "snapshots"]
    if repo_type == "dataset":
        root = os.environ.get("HF_DATASETS_CACHE") or os.path.join(constants.HF_HOME, "datasets")
        caches.append(Path(root) / repo_id.replace("/", "___"))
    cached = next((c for c in caches if c.is_dir() and any(c.iterdir())), None)
    return HubName(what, repo_id, repo_type, cached is not None), cached, caches


def unreachable(timeout: float = TIMEOUT_S) -> str | None:
    """Why the hub's endpoint (``HF_ENDPOINT``) cannot be reached, or None when it answers (any HTTP
    status: a server that answers is reachable). Proxies from the environment are used, as the libraries do."""
    import urllib.error
    import urllib.request

    from huggingface_hub import constants

    try:
        with urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=timeout):
            return None
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        return f"{constants.ENDPOINT}: {reason}"


def check_hub_access(names: list[HubName], say=print) -> None:
    """Ask the hub once when ``names`` is not empty (module docstring): go offline from the cache, or raise a
    ``ValueError`` naming every repo that is not cached and what to do."""
    from huggingface_hub import constants

    if not names or constants.HF_HUB_OFFLINE:
        return
    why = unreachable()
    if why is None:
        return
    missing = [n for n in names if not n.cached]
    if not missing:
        os.environ["HF_HUB_OFFLINE"] = "1"  # read by datasets at its import, which comes later
        constants.HF_HUB_OFFLINE = True  # read by huggingface_hub and transformers on each call
        say(f"unirl: the hub cannot be reached ({why}); {', '.join(n.repo_id for n in names)} "
            f"{'is' if len(names) == 1 else 'are'} in the local cache, so the run goes on offline (HF_HUB_OFFLINE=1)")
        return
    shown = "; ".join(f"{n.what}={n.repo_id} (a hub {n.repo_type}, not in the local cache)" for n in missing)
    fetch = " && ".join(f"hf download {n.repo_id}" + (" --repo-type dataset" if n.repo_type == "dataset" else "")
                        for n in missing)
    raise ValueError(f"{shown}: the hub cannot be reached ({why}). Give a local path instead ({missing[0].what}=/path/"
                     f"to/it), or download where there is a network ({fetch}), copy the cache ({constants.HF_HUB_CACHE}) "
                     f"here and run with HF_HUB_OFFLINE=1")

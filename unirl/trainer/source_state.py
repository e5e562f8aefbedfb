"""The batch source's in-flight batches in a checkpoint (``trainer_state/source.*``; docs/async.md), each
process's own.

Several processes each run their own producer on their own share of the prompts (docs/async.md, "What runs
where"), so each holds its own batches sampled ahead. One process writes ``source.{json,safetensors}`` (the
names of earlier versions, which still resume); W processes write ``source.rank<r>of<W>.{json,safetensors}``
each, named as ``unirl.trainer.sharded_state`` names shards, and each process reads back its own. Earlier
versions wrote the main process's batches only, and every process read them: after a resume every process
trained on the main process's batches (the same data W times) and the others' were lost.

Batches already sampled cannot be split again over another number of processes (each holds the samples of its
process's share of the prompts), so a checkpoint whose batches were written by another number of processes, or
by an earlier version on several, is a ``StateFileError`` naming the file and the way out, as for damaged batches:
delete the source files, and resume samples them again with the checkpoint's weights (not exact).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from unirl.trainer.state_files import StateFileError, load_state, save_state



def own_stem(stem: Path, rank: int, world: int) -> Path:
    """This process's file stem: ``stem`` itself on one process (earlier versions' names), else its rank's."""
    return stem if world == 1 else Path(f"{stem}.rank{rank}of{world}")


def save_source(accelerator, source: Any, stem: Path) -> None:
    """Every process drains its producer and writes its own batches (``own_stem``)."""
    save_state(source.state_dict(), own_stem(stem, accelerator.process_index, accelerator.num_processes))


def read_source(accelerator, stem: Path, step: int) -> tuple[Path, Any]:
    """This process's stem and its batches' state (None: every file deleted, so the batches are sampled again,
    said in one line), from the files ``save_source`` wrote (or an FSDP2 one-process run's ``source.rank0of1``).
    Damage, another number of processes or a file missing is a ``StateFileError`` with the way out; every process
    sees the same files, so each raises the same error for all but a damaged file's content."""
    world, rank = accelerator.num_processes, accelerator.process_index
    plain, worlds = _written(stem)
    if not plain and not worlds:
        deleted = f"{stem}.json and .safetensors are" if world == 1 else f"{stem}.rank*of{world} files are"
        accelerator.print(f"resume: {deleted} deleted: the batches in flight at step {step} are sampled again with "
                          f"its weights (the run now differs from an uninterrupted one, whose batches were sampled "
                          f"with older weights)")
        return stem, None
    written_by = len(list(stem.parent.glob("rng_*.json")))  # one a process
    if plain and written_by > 1:
        raise StateFileError(f"{stem}.json: holds the main process's in-flight batches only (an earlier unirl saved "
                             f"no other's; written by {written_by} processes){resample_hint(stem)}")
    saved = sorted(worlds | ({1} if plain else set()))
    if saved != [world]:
        raise StateFileError(f"{stem}.{'json' if plain else f'rank*of{saved[0]}.json'}: in-flight batches of "
                             f"{' and '.join(map(str, saved))} process(es), this run has {world}; batches already "
                             f"sampled cannot be split again over another number of processes{resample_hint(stem)}")
    for r in range(0 if plain else world):  # every process's, so every process names the one missing
        for suffix in (".json", ".safetensors"):
            if not Path(f"{stem}.rank{r}of{world}{suffix}").exists():
                raise StateFileError(f"{stem}.rank{r}of{world}{suffix}: missing (written by {world} processes)"
                                     f"{resample_hint(stem)}")
    own = stem if plain else Path(f"{stem}.rank{rank}of{world}")
    try:
        return own, load_state(own)
    except StateFileError as e:
        raise StateFileError(f"{e}{resample_hint(stem)}") from None


def resample_hint(stem: Path) -> str:
    """The way out of a checkpoint whose in-flight batches cannot be used (docs/async.md)."""
    _, worlds = _written(stem)
    files = (f"{stem.name}.json and {stem.name}.safetensors" if not worlds else
             f"{stem.name}.rank*.json and {stem.name}.rank*.safetensors (every process's)")
    return (f"; to resume from this checkpoint anyway, delete its {files} and the batches are sampled again (not "
            f"exact, docs/async.md)")


def _written(stem: Path) -> tuple[bool, set[int]]:
    """Whether ``stem.{json,safetensors}`` is there (either), and the numbers of processes of its rank files."""
    plain = any(Path(f"{stem}{suffix}").exists() for suffix in (".json", ".safetensors"))
    pattern = re.compile(rf"{re.escape(stem.name)}\.rank(\d+)of(\d+)\.(json|safetensors)")
    worlds = {int(m.group(2)) for f in stem.parent.glob(f"{stem.name}.rank*") if (m := pattern.fullmatch(f.name))}
    return plain, worlds

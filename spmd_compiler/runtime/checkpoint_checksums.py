"""SHA-256 of every stored tensor chunk of a checkpoint, written at save, verified at load.

NOTE: [checkpoint checksums]
``torch.distributed.checkpoint`` stores each tensor chunk (a rank's shard, at its global
offset) as a byte range of one data file and lists the ranges in the pickled
``.metadata``; it checks neither. A flipped byte in a payload loaded silently (training
continued with other losses) and a damaged pickle surfaced as torch's advice to retry
with ``weights_only=False``. So after ``dcp.save`` every rank hashes an equal share of
the byte ranges (every ``world``-th chunk in a fixed order), one all-reduce gathers the
digests, and rank 0 writes ``MANIFEST`` (JSON): the hash of ``.metadata`` and, per chunk,
its tensor name, offset, file, byte range and hash. ``load`` reads the manifest (never
the pickle) first: each rank re-hashes its share, one all-reduce of the mismatch flags
lets every rank raise the same ``CheckpointError`` naming each chunk that differs. The
verification reads the checkpoint once more (split across the ranks). Tensor
collectives only (object collectives need numpy).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

MANIFEST = "spmd_checksums.json"
METADATA_FILE = ".metadata"
FORMAT_VERSION = 1
_DIGEST_WORDS = 4  # a SHA-256 digest as 4 int64 words, for an all-reduce
_READ_BLOCK = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint that is damaged, incomplete or not written by ``checkpoint.save``."""


# A collective over the ranks taking part: all_reduce(tensor, op) in place, or a no-op.
AllReduce = Callable[[torch.Tensor, Any], None]


def process_group_all_reduce(tensor: torch.Tensor, op: Any) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=op)


def write_manifest(
    folder: str, metadata: Any, rank: int, world: int, all_reduce: AllReduce
) -> None:
    """Hash this rank's share of the chunks ``metadata`` lists; rank 0 writes the manifest.

    A collective when ``world > 1``: every rank calls it after ``dcp.save``.
    """
    entries = _entries(metadata)
    words = torch.zeros(len(entries), _DIGEST_WORDS, dtype=torch.int64)
    for i in range(rank, len(entries), world):
        words[i] = _words(_hash_range(folder, entries[i]))
    all_reduce(words, dist.ReduceOp.SUM)  # every row is set on one rank, zero elsewhere
    if rank == 0:
        for entry, row in zip(entries, words):
            entry["sha256"] = _hex(row)
        manifest = {
            "format": FORMAT_VERSION,
            "metadata_sha256": _hash_file(os.path.join(folder, METADATA_FILE)),
            "chunks": entries,
        }
        tmp = os.path.join(folder, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1)
        os.replace(tmp, os.path.join(folder, MANIFEST))
    all_reduce(torch.zeros(1), dist.ReduceOp.SUM)  # no rank returns before the manifest exists


def verify(folder: str, rank: int, world: int, all_reduce: AllReduce) -> None:
    """Raise ``CheckpointError`` on every rank when a chunk or the metadata differs from
    the manifest ``save`` wrote. A collective when ``world > 1``."""
    manifest = _read_manifest(folder)
    problems: list[str] = []
    metadata_path = os.path.join(folder, METADATA_FILE)
    if not os.path.exists(metadata_path):
        problems.append(f"{METADATA_FILE} is missing")
    elif _hash_file(metadata_path) != manifest["metadata_sha256"]:
        problems.append(f"{METADATA_FILE} (the pickled index of the checkpoint) differs")
    chunks = manifest["chunks"]
    bad = torch.zeros(len(chunks), dtype=torch.int64)
    for i in range(rank, len(chunks), world):
        try:
            same = _hash_range(folder, chunks[i]) == chunks[i]["sha256"]
        except OSError:
            same = False
        bad[i] = 0 if same else 1
    flags = torch.tensor([1 if problems else 0], dtype=torch.int64)
    all_reduce(bad, dist.ReduceOp.MAX)
    all_reduce(flags, dist.ReduceOp.MAX)
    if flags.item() and not problems:
        problems.append(f"{METADATA_FILE} differs on another rank's file system")
    problems += [_describe(chunks[i]) for i in bad.nonzero().flatten().tolist()]
    if problems:
        raise CheckpointError(
            f"checkpoint {folder} is damaged: its checksums ({MANIFEST}, written at save) "
            "do not match:\n  " + "\n  ".join(problems) + "\nRestore it from a copy or "
            "use an earlier checkpoint; loading it would silently change the model."
        )


def _read_manifest(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        raise CheckpointError(
            f"{folder} has no {MANIFEST}: it was not written by spmd_compiler.runtime.checkpoint.save "
            "(or the save did not finish), so it cannot be verified. Pass verify_checksums=False to "
            "load it unverified."
        )
    try:
        with open(path) as f:
            manifest = json.load(f)
        ok = manifest.get("format") == FORMAT_VERSION and all(
            {"fqn", "file", "start", "length", "sha256"} <= set(c) for c in manifest["chunks"]
        ) and isinstance(manifest["metadata_sha256"], str)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{path} is damaged: {type(exc).__name__}: {exc}") from exc
    if not ok:
        raise CheckpointError(f"{path} is damaged or of another format version")
    return manifest


def _entries(metadata: Any) -> list[dict[str, Any]]:
    """One entry per stored chunk, in a fixed order (the same on every rank)."""
    out = []
    for index, info in metadata.storage_data.items():
        out.append({
            "fqn": index.fqn,
            "offset": list(index.offset) if index.offset is not None else None,
            "file": info.relative_path,
            "start": int(info.offset),
            "length": int(info.length),
        })
    out.sort(key=lambda e: (e["fqn"], e["offset"] or [], e["file"], e["start"]))
    return out


def _describe(chunk: dict[str, Any]) -> str:
    offset = chunk["offset"]
    where = f" (its chunk at offset {tuple(offset)})" if offset and any(offset) else ""
    return (
        f"tensor {chunk['fqn']} differs{where}: {chunk['file']} bytes "
        f"{chunk['start']}..{chunk['start'] + chunk['length']}"
    )


def _hash_range(folder: str, entry: dict[str, Any]) -> str:
    digest = hashlib.sha256()
    with open(os.path.join(folder, entry["file"]), "rb") as f:
        f.seek(entry["start"])
        left = entry["length"]
        while left > 0:
            block = f.read(min(left, _READ_BLOCK))
            if not block:
                break  # a truncated file: the digest will not match
            digest.update(block)
            left -= len(block)
    return digest.hexdigest()


def _hash_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _words(hex_digest: str) -> torch.Tensor:
    raw = bytes.fromhex(hex_digest)
    return torch.tensor(
        [int.from_bytes(raw[8 * i : 8 * i + 8], "big", signed=True) for i in range(_DIGEST_WORDS)],
        dtype=torch.int64,
    )


def _hex(words: torch.Tensor) -> str:
    return b"".join(int(w).to_bytes(8, "big", signed=True) for w in words.tolist()).hex()

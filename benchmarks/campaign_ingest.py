"""Bring one campaign stint home: what a device call of benchmarks/gpu/campaign_stint.py sent back, joined and
checked, unpacked, recorded, scored on the frozen yardstick beside the shipped drafter, and shipped when better.

    python benchmarks/campaign_ingest.py FOLDER             # join, unpack, record; say what --promote would do
    python benchmarks/campaign_ingest.py FOLDER --threads 2 --limit 40 \
        --yardstick benchmarks/yardstick/sharegpt-heldout-100.jsonl --yardstick benchmarks/yardstick/humaneval-164.jsonl
    python benchmarks/campaign_ingest.py FOLDER --promote   # + export over the shipped drafter when it is better

FOLDER holds stint.json, stint.log, bundle.tar.part* and SHA256 (`benchmarks/gpu/parts.sh split`'s layout).
The steps, each a no-op when its inputs did not change (a progress line each):

1. unpack: join the parts, check their sha256, unpack into .data/campaign/stint-K/ (git-ignored); a different
   bundle of the same stint (a later call's) replaces it only with --overwrite;
2. yardstick (--yardstick FILE, repeatable): `flashdraft eval --references FILE` on the CPU in float32, the
   shipped drafter first (the baseline of the report's paired per-prompt comparison) and the stint's beside it;
   run again only when the file, the options or either drafter's weights changed. Or (--report REPORT.json
   --report-drafter NAME) the same eval made on a GPU, adopted: minutes there instead of hours here;
3. results: the small files (stint.json, metrics.jsonl, config.yaml, the eval and yardstick reports; no weights)
   and the stint's new data packed into one file (new-data.fdpack, `flashdraft data pack`: the unpacked folder
   lives on this workstation only, the pack in git, and `campaign_stint.py --prev-data` takes it) into
   benchmarks/results/campaign/stint-K/;
4. stints.jsonl: the stint's line (stint.json plus the yardstick τ and paired verdicts) replaces its earlier line;
5. promote: only when, by the paired test (mean per-prompt Δτ at least two standard errors from 0), the chain τ
   is better on at least one held-out yardstick and worse on none, the ShareGPT one among them (a code-heavy
   stint may move HumanEval and leave chat where it was): `flashdraft export --overwrite` of the stint's drafter over --models,
   the model card's hand-written sections kept and its "## Campaign" section regenerated from stints.jsonl.
   Without --promote it says what it would do;
6. curve: benchmarks/plot_learning_curve.py redraws benchmarks/results/campaign/learning_curve.png, with its fit
   of τ against ln(training minutes) from stint 3 on dotted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts beside this one
import plot_learning_curve  # noqa: E402  (benchmarks/plot_learning_curve.py: the curve and the stints reader)

from flashdraft.eval.frozen import read_frozen_records
from flashdraft.files import atomic_folder, atomic_write_text, file_sha256

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "models" / "smollm2-135m-instruct-dflash-b16"
RESULTS = REPO / "benchmarks" / "results" / "campaign"
DATA = REPO / ".data" / "campaign"
GATE = "sharegpt-heldout"  # the yardstick a promotion needs (its file name starts so) beside any others
CARD_HEADING = "## Campaign"
# copied into the results folder, with eval/*/ and yardstick/*/ report.json and report.md
SMALL_FILES = ("stint.json", "metrics.jsonl", "config.yaml")

EvalRunner = Callable[[list[str], Path], int]  # (flashdraft CLI args, log file) -> exit status
Exporter = Callable[[Path, Path, str], None]  # (drafter folder, models folder, target) -> exported, or raises


class IngestError(Exception):
    pass


def say(step: str, msg: str) -> None:
    print(f"[{step}] {msg}", flush=True)


# ----------------------------------------------------------------------------- 1. unpack


def read_stint(folder: Path) -> dict[str, Any]:
    f = folder / "stint.json"
    if not f.is_file():
        raise IngestError(
            f"{f}: missing (campaign_stint.py writes it to $OUT with every call): fetch it again"
        )
    try:
        stint = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise IngestError(f"{f}: not JSON ({e.msg}, line {e.lineno}): fetch it again") from None
    if not isinstance(stint.get("stint"), int) or stint["stint"] < 0:
        raise IngestError(f"{f}: field 'stint' is {stint.get('stint')!r}, not a stint index >= 0")
    return stint


def bundle_parts(folder: Path) -> tuple[list[Path], str]:
    """bundle.tar's parts in order and the sha256 the SHA256 file gives for the whole; a gap in the numbering or
    a missing SHA256 is an error."""
    parts = sorted(folder.glob("bundle.tar.part*"))
    if not parts:
        raise IngestError(f"{folder}: no bundle.tar.part* (the call shipped no bundle): nothing to unpack")
    for k, p in enumerate(parts):
        if p.name != f"bundle.tar.part{k:02d}":
            raise IngestError(
                f"{folder / f'bundle.tar.part{k:02d}'}: missing (next is {p.name}): fetch it again"
            )
    sums = folder / "SHA256"
    if not sums.is_file():
        raise IngestError(f"{sums}: missing (parts.sh split writes it beside the parts): fetch it again")
    fields = sums.read_text().split()
    if len(fields) != 2 or fields[1] != "bundle.tar" or len(fields[0]) != 64:
        raise IngestError(f"{sums}: expected one line 'SHA256  bundle.tar', got {sums.read_text()[:80]!r}")
    return parts, fields[0]


def join_parts(parts: list[Path], want: str, dest: Path) -> None:
    """Concatenate `parts` into `dest` (through a temp file), checking the sha256 on the way."""
    h, tmp = hashlib.sha256(), dest.with_name(dest.name + ".tmp")
    with tmp.open("wb") as out:
        for p in parts:
            with p.open("rb") as f:
                for block in iter(lambda f=f: f.read(1 << 20), b""):
                    h.update(block)
                    out.write(block)
    if h.hexdigest() != want:
        tmp.unlink()
        raise IngestError(
            f"{parts[0].parent}/bundle.tar.part*: joined sha256 {h.hexdigest()[:16]}…, SHA256 says {want[:16]}…: "
            "a part is damaged or missing; fetch the parts again"
        )
    tmp.replace(dest)


def unpack(folder: Path, stint: dict[str, Any], data: Path, overwrite: bool) -> Path:
    """.data/campaign/stint-K/: the bundle's contents plus stint.json, stint.log and SHA256 (which bundle it is)."""
    parts, want = bundle_parts(folder)
    dest = data / f"stint-{stint['stint']}"
    have = dest / "SHA256"
    if have.is_file() and have.read_text().split()[:1] == [want]:
        say("unpack", f"{dest}: already holds this bundle (sha256 {want[:12]}…)")
        return dest
    if dest.exists() and not overwrite:
        raise IngestError(
            f"{dest}: holds another bundle of stint {stint['stint']}: pass --overwrite to replace it"
        )
    data.mkdir(parents=True, exist_ok=True)
    with atomic_folder(dest, overwrite=overwrite, tag="unpack") as tmp:
        tar = tmp / "bundle.tar"
        join_parts(parts, want, tar)
        with tarfile.open(tar) as tf:
            tf.extractall(tmp, filter="data")  # no absolute paths, links out, or device files
        tar.unlink()
        for name in ("stint.json", "stint.log", "SHA256"):
            if (folder / name).is_file():
                shutil.copyfile(folder / name, tmp / name)
        # a stint's training call comes home after its regeneration's, without the new data: keep that data
        if not (tmp / "new-data").exists() and (dest / "new-data" / "manifest.json").is_file():
            shutil.copytree(dest / "new-data", tmp / "new-data")
            if (dest / "new-data.fdpack").is_file():
                shutil.copyfile(dest / "new-data.fdpack", tmp / "new-data.fdpack")
            say("unpack", f"{dest}: kept the new data of the bundle it replaces (this one has none)")
    say("unpack", f"{len(parts)} parts joined, sha256 {want[:12]}… checked, unpacked into {dest}")
    return dest


# ----------------------------------------------------------------------------- 2. yardstick


def run_flashdraft(args: list[str], log: Path) -> int:
    """`python -m flashdraft.cli ARGS` with this checkout's package, its output into `log`."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    with log.open("w") as f:
        return subprocess.run(
            [sys.executable, "-m", "flashdraft.cli", *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env,
        ).returncode


def eval_args(
    yardstick: Path,
    models: Path,
    drafter: Path,
    out: Path,
    target: str,
    limit: int | None,
    threads: int | None,
) -> list[str]:
    try:
        head, _ = read_frozen_records(yardstick, limit=1)
    except (FileNotFoundError, ValueError) as e:
        raise IngestError(f"--yardstick {e}") from None
    args = ["eval", "--target", target, "--drafter", str(models), "--drafter", str(drafter),
            "--references", str(yardstick), "--max-new-tokens", str(head["max_new_tokens"]),
            "--device", "cpu", "--dtype", "float32", "--no-progress", "--out", str(out)]  # fmt: skip
    args += ["--limit", str(limit)] if limit else []
    return args + (["--threads", str(threads)] if threads else [])


def shipped_now(unpacked: Path, models: Path) -> bool:
    """Whether the shipped weights are this stint's export (an earlier --promote)."""
    mark = unpacked / "promoted.json"
    weights = models / "model.safetensors"
    return (
        mark.is_file()
        and weights.is_file()
        and json.loads(mark.read_text())["models_sha256"] == file_sha256(weights)
    )


def yardstick(
    files: list[Path], unpacked: Path, models: Path, a: argparse.Namespace, run_eval: EvalRunner
) -> None:
    """Each yardstick's report in UNPACKED/yardstick/STEM/, beside ingest.json: what it was computed from."""
    drafter = unpacked / "drafter"
    for f in files:
        for need in (drafter / "model.safetensors", models / "model.safetensors"):
            if not need.is_file():
                raise IngestError(
                    f"{need}: missing: the yardstick compares the stint's drafter with the shipped one"
                )
        out = unpacked / "yardstick" / f.stem
        args = eval_args(f, models, drafter, out, a.target, a.limit, a.threads)
        key = {"args": args, "yardstick_sha256": file_sha256(f), "baseline_sha256": file_sha256(models / "model.safetensors"),
               "drafter_sha256": file_sha256(drafter / "model.safetensors")}  # fmt: skip
        mark = out / "ingest.json"
        old = json.loads(mark.read_text()) if mark.is_file() and (out / "report.json").is_file() else None
        if old == key:
            say("yardstick", f"{f.stem}: already evaluated with these drafters and options")
            continue
        if (
            old is not None
            and {**old, "baseline_sha256": None} == {**key, "baseline_sha256": None}
            and shipped_now(unpacked, models)
        ):
            say(
                "yardstick",
                f"{f.stem}: evaluated against the drafter shipped before this stint's promotion; kept",
            )
            continue
        say("yardstick", f"{f.stem}: flashdraft {' '.join(args)}")
        out.parent.mkdir(parents=True, exist_ok=True)
        mark.unlink(missing_ok=True)  # an eval that fails halfway leaves no report that looks finished
        t = time.perf_counter()
        rc = run_eval(args, out.parent / f"{f.stem}.log")
        if rc != 0 or not (out / "report.json").is_file():
            raise IngestError(
                f"flashdraft eval on {f} failed (exit {rc}): see {out.parent / f'{f.stem}.log'}"
            )
        atomic_write_text(mark, json.dumps(key, indent=1) + "\n")
        say("yardstick", f"{f.stem}: done in {(time.perf_counter() - t) / 60:.1f} min, {out / 'report.md'}")


def adopt_reports(
    files: list[Path], name: str | None, unpacked: Path, models: Path, evaluated: set[str] = frozenset()
) -> None:
    """Yardstick reports made elsewhere (`flashdraft eval --references benchmarks/yardstick/FILE` on a GPU, float32,
    T = 0, the shipped drafter first) kept as this stint's, in UNPACKED/yardstick/STEM/: `name` is the stint's drafter
    in them (a report may hold several stints' drafters, each paired with the shipped one). Where the report names
    the weights it scored (`weights_sha256`), they must be this stint's and the shipped ones; a report without them
    is kept as unverified, which no promotion accepts."""
    if bool(files) != bool(name):
        raise IngestError(
            "--report and --report-drafter go together: the reports, and the stint's drafter in them"
        )
    if not files:
        return
    drafter_sha, shipped_sha = (
        file_sha256(unpacked / "drafter" / "model.safetensors"),
        file_sha256(models / "model.safetensors"),
    )
    for f in files:
        try:
            r = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise IngestError(f"--report {f}: not a readable report.json ({e})") from None
        drafters = (r.get("drafters") or {}) if isinstance(r, dict) else {}
        source = str(((r.get("references") or {}).get("source")) or "") if drafters else ""
        if not drafters or not source.startswith("frozen:"):
            raise IngestError(
                f"--report {f}: not an eval report on a frozen yardstick (references.source {source!r})"
            )
        stem = Path(source.removeprefix("frozen:")).stem
        if stem in evaluated:
            raise IngestError(f"--report {f}: {stem} is also given by --yardstick; pick one")
        frozen = REPO / "benchmarks" / "yardstick" / f"{stem}.jsonl"
        want = {"dtype": "float32", "temperature": 0.0}
        if frozen.is_file():
            want["max_new_tokens"] = read_frozen_records(frozen, limit=1)[0]["max_new_tokens"]
        got = {k: r.get(k) for k in want}
        if got != want:
            raise IngestError(f"--report {f}: made with {got}, the yardstick is scored with {want}")
        first, *rest = drafters
        if first != models.name:
            raise IngestError(
                f"--report {f}: its first drafter is {first!r}, not the shipped {models.name!r}"
            )
        if name not in rest:
            raise IngestError(f"--report {f}: --report-drafter {name!r} is not one of {rest}")
        for who, entry, sha in (
            ("shipped", drafters[first], shipped_sha),
            (name, drafters[name], drafter_sha),
        ):
            if entry.get("weights_sha256") not in (None, sha):
                raise IngestError(
                    f"--report {f}: its {who} drafter's weights are not {'this stint' if who == name else 'the shipped'}'s (sha256 {entry['weights_sha256'][:12]}…, here {sha[:12]}…)"
                )
        verified = all(drafters[k].get("weights_sha256") for k in (first, name))
        out = unpacked / "yardstick" / stem
        key = {"report": str(f), "report_sha256": file_sha256(f), "drafter": name, "baseline_sha256": shipped_sha,
               "weights_verified": verified}  # fmt: skip
        mark = out / "ingest.json"
        if mark.is_file() and json.loads(mark.read_text()) == key:
            say("yardstick", f"{stem}: already adopted from {f}")
            continue
        out.mkdir(parents=True, exist_ok=True)
        mark.unlink(missing_ok=True)
        for part in ("report.json", "report.md"):
            if (f.parent / part).is_file():
                atomic_write_text(out / part, (f.parent / part).read_text())
        atomic_write_text(mark, json.dumps(key, indent=1) + "\n")
        how = "weights checked" if verified else "weights not named in the report: unverified, never promoted"
        say("yardstick", f"{stem}: adopted {f} (drafter {name!r} beside {first!r}; {how})")


def _taus(d: dict[str, Any]) -> dict[str, Any]:
    trees = {k: v["tau"] for k, v in d["methods"].items() if k.startswith("ddtree-")}
    best = max(trees, key=trees.__getitem__) if trees else None
    return {"chain_tau": d["methods"]["chain"]["tau"], "ddtree_tau": trees.get(best), "ddtree_budget": best,
            "topk8_streak": d["methods"].get("topk-8", {}).get("tau")}  # fmt: skip


def yardstick_summary(unpacked: Path) -> dict[str, Any]:
    """STEM -> the stint's and the shipped drafter's τ, and the paired per-prompt verdicts of stint vs shipped."""
    out = {}
    for rep in sorted((unpacked / "yardstick").glob("*/report.json")):
        r = json.loads(rep.read_text())
        key = json.loads((rep.parent / "ingest.json").read_text())
        (base, b), *_, (new, d) = r["drafters"].items()
        if key.get("drafter"):  # an adopted report: the stint's drafter by name
            new, d = key["drafter"], r["drafters"][key["drafter"]]
        paired = (d.get("paired") or {}).get("methods") or {}
        out[rep.parent.name] = {
            "prompts": d["samples"], "new": _taus(d), "shipped": _taus(b), "baseline": base, "drafter": new,
            "baseline_sha256": key["baseline_sha256"], "verified": key.get("weights_verified", True),
            "paired": {m: {k: round(v, 4) if isinstance(v, float) else v for k, v in p.items()} for m, p in paired.items()},
        }  # fmt: skip
    return out


# ----------------------------------------------------------------------------- 3. results, 4. stints.jsonl


def small_files(unpacked: Path) -> dict[str, bytes]:
    files = {n: (unpacked / n).read_bytes() for n in SMALL_FILES if (unpacked / n).is_file()}
    for sub in ("eval", "yardstick"):
        for rep in sorted((unpacked / sub).glob("*/report.*")):
            if rep.suffix in (".json", ".md"):
                files[f"{sub}/{rep.parent.name}/{rep.name}"] = rep.read_bytes()
    return files


def data_pack(unpacked: Path) -> dict[str, bytes]:
    """{"new-data.fdpack": bytes} when the bundle brought the stint's new data (packed once, kept beside it)."""
    new, pack = unpacked / "new-data", unpacked / "new-data.fdpack"
    if not (new / "manifest.json").is_file():
        return {}
    if not pack.is_file():
        from flashdraft.data.dataset import DatasetError
        from flashdraft.data.pack import pack_dataset

        try:
            st = pack_dataset(new, pack)
        except DatasetError as e:
            raise IngestError(f"pack {new}: {e}") from None
        mib = st["bytes"] / 2**20
        say("pack", f"{pack}: {st['samples']:,} samples, {st['tokens']:,} tokens in {mib:.2f} MiB")
    return {"new-data.fdpack": pack.read_bytes()}


def write_results(files: dict[str, bytes], dest: Path, overwrite: bool) -> None:
    """DEST holds exactly `files`. Without --overwrite a file there that the stint no longer has, or a bundle file
    whose bytes differ, is refused (yardstick reports are this script's own and may change)."""
    have = (
        {p.relative_to(dest).as_posix(): p for p in dest.rglob("*") if p.is_file()} if dest.is_dir() else {}
    )
    if {k: p.read_bytes() for k, p in have.items()} == files:
        say("results", f"{dest}: unchanged ({len(files)} files)")
        return
    if not overwrite:
        for rel, p in have.items():
            if rel not in files or (not rel.startswith("yardstick/") and p.read_bytes() != files[rel]):
                raise IngestError(
                    f"{p}: not what this stint's bundle holds: pass --overwrite to replace {dest}"
                )
    with atomic_folder(dest, overwrite=True, tag="results") as tmp:
        for rel, data in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_bytes(data)
    say("results", f"{dest}: {len(files)} files, {sum(map(len, files.values())) / 1024:.0f} KiB")


def stint_line(unpacked: Path) -> dict[str, Any]:
    line = json.loads((unpacked / "stint.json").read_text())
    new = unpacked / "new-data"
    if (new / "manifest.json").is_file():
        # how much of the new answers loops (`flashdraft data inspect`): the train split's shares
        from flashdraft.data.dataset import DatasetError, open_dataset
        from flashdraft.data.inspect import repetition_stats

        try:
            rep = repetition_stats(open_dataset(str(new), "train")).summary()
        except DatasetError as e:
            raise IngestError(f"{new}: {e}") from None
        line["new"] = {**(line.get("new") or {}), "repetition": rep}
    ys = yardstick_summary(unpacked)
    if ys:
        line["yardstick"] = ys
    if (unpacked / "promoted.json").is_file():
        line["promoted"] = json.loads((unpacked / "promoted.json").read_text())["date"]
    return line


def read_lines(path: Path) -> list[dict[str, Any]]:
    """stints.jsonl's rows through the learning curve's reader; a bad line is an IngestError naming it."""
    try:
        return plot_learning_curve.read_rows(path)
    except ValueError as e:
        raise IngestError(str(e)) from None


def upsert(path: Path, line: dict[str, Any]) -> list[dict[str, Any]]:
    """The stint's line replaces the line of the same stint (or is added); lines in stint order."""
    old = read_lines(path)
    rows = sorted([r for r in old if r.get("stint") != line["stint"]] + [line], key=lambda r: r["stint"])
    if rows == old:
        say("stints", f"{path}: stint {line['stint']} unchanged ({len(rows)} stints)")
    else:
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
        say("stints", f"{path}: stint {line['stint']} written ({len(rows)} stints)")
    return rows


# ----------------------------------------------------------------------------- 5. promote


def promote_decision(line: dict[str, Any]) -> tuple[bool, str]:
    """(promote?, why): by the paired per-prompt chain τ verdicts on the held-out yardsticks, the stint's drafter
    must be better on at least one and worse on none; the held-out ShareGPT one must be among them."""
    ys = line.get("yardstick") or {}
    if not any(k.startswith(GATE) for k in ys):
        return False, (f"stint {line['stint']} has no {GATE} yardstick result: run with --yardstick "
                       f"benchmarks/yardstick/{GATE}-100.jsonl")  # fmt: skip
    whats, better = [], []
    for name in sorted(ys):
        if not ys[name].get("verified", True):
            return False, f"{name}: an adopted report that names no weights: evaluate again with this flashdraft"
        c = ys[name]["paired"].get("chain") or {}
        if c.get("se") is None:
            return False, f"{name}: no paired chain τ over two or more prompts (n={c.get('n', 0)})"
        what = f"{name}: chain Δτ {c['delta']:+.3f} ± {c['se']:.3f} SE over {c['n']} prompts, {c.get('verdict')}"
        if c.get("verdict") == "worse":
            return False, f"{what}: two SE worse than the shipped drafter"
        whats.append(what)
        better.append(c.get("verdict") == "better")
    if not any(better):
        return False, "; ".join(whats) + ": better on none, by two SE, than the shipped drafter"
    return True, "; ".join(whats) + ": better than the shipped drafter, worse on none"


def _m(x: Any, nd: int = 1) -> str:
    return "—" if x is None else f"{x:.{nd}f}"


def campaign_section(rows: list[dict[str, Any]]) -> str:
    sets = sorted({s for r in rows for s in r.get("yardstick") or {}})
    head = ["stint", "date", "card", "GPU min", "training min", "steps", "new samples", "new loss tokens",
            "of them repeating an earlier 8-gram / answers at the cap", "regenerated so far: samples / loss tokens", "trained on: samples / loss tokens", "val chain τ",
            *(f"{s} chain / DDTree τ" for s in sets), "shipped"]  # fmt: skip
    lines = [
        CARD_HEADING, "",
        "<!-- generated by benchmarks/campaign_ingest.py from benchmarks/results/campaign/stints.jsonl; edits here "
        "are replaced -->", "",
        "One row per GPU stint of `benchmarks/gpu/campaign_stint.py`: GPU minutes of all its phases, minutes and "
        "optimizer steps of training, the samples and loss tokens it regenerated (how much of them loops: `flashdraft "
        "data inspect`; and all stints' so far, in "
        "stint order: the drafter's lineage), the merged dataset it trained on (this stint's data and the "
        "earlier stints' it chose to keep), the trainer's last validation chain τ, and the frozen yardstick's chain / best-DDTree τ "
        "(`flashdraft eval --references benchmarks/yardstick/FILE`, float32, beside the drafter shipped then). "
        "Learning curve: `benchmarks/results/campaign/learning_curve.png`.", "",
        "| " + " | ".join(head) + " |", "|---|---|---|" + "---:|" * (len(head) - 4) + "---|",
    ]  # fmt: skip
    tok = lambda x: "—" if x is None else f"{x / 1e6:.2f}M"  # noqa: E731
    num = lambda x: "—" if x is None else f"{x:,}"  # noqa: E731
    so_far = {"samples": 0, "loss_tokens": 0}
    share = lambda x: "—" if x is None else f"{x:.0%}"  # noqa: E731
    for r in sorted(rows, key=lambda r: r["stint"]):
        new, cum = r.get("new") or {}, r.get("cumulative") or {}
        loops = new.get("repetition")
        for k in so_far:
            so_far[k] += new.get(k) or 0
        ys = r.get("yardstick") or {}
        cells = [str(r["stint"]), r.get("date", "—"), r.get("card", "—"), _m(r.get("gpu_minutes")),
                 _m(r.get("train_minutes")), num(r.get("train_steps")), num(new.get("samples")),
                 tok(new.get("loss_tokens")),
                 f"{share(loops['repeated'])} / {share(loops['at_cap'])}" if loops else "—",
                 f"{num(so_far['samples'])} / {tok(so_far['loss_tokens'])}",
                 f"{num(cum.get('samples'))} / {tok(cum.get('loss_tokens'))}" if cum else "—",
                 _m((r.get("val") or {}).get("val/chain_tau"), 2)]  # fmt: skip
        cells += [f"{_m(ys[s]['new']['chain_tau'], 2)} / {_m(ys[s]['new']['ddtree_tau'], 2)}" if s in ys else "—"
                  for s in sets]  # fmt: skip
        lines.append("| " + " | ".join(cells + [r.get("promoted", "")]) + " |")
    return "\n".join(lines) + "\n"


def replace_section(card: str, section: str) -> str:
    """`card` with its "## Campaign" section (up to the next "## " heading) replaced by `section`, or with
    `section` added at the end."""
    lines = card.splitlines(keepends=True)
    start = next((i for i, x in enumerate(lines) if x.rstrip() == CARD_HEADING), None)
    if start is None:
        return card.rstrip("\n") + "\n\n" + section
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    tail = "".join(lines[end:])
    return "".join(lines[:start]) + section + ("\n" + tail if tail else "")


def export_shipped(drafter: Path, models: Path, target: str) -> None:
    from flashdraft.serve.export import export_drafter

    try:
        export_drafter(drafter, models, dtype="bfloat16", target=target, overwrite=True)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        raise IngestError(f"export {drafter} -> {models}: {e}") from None


def promote(line: dict[str, Any], unpacked: Path, a: argparse.Namespace, export: Exporter) -> bool:
    """Export the stint's drafter over --models when the gate says so (or it is shipped already); True when
    the stint is the shipped drafter afterwards."""
    models = Path(a.models)
    if shipped_now(unpacked, models):
        say("promote", f"{models}: already this stint's drafter")
        return True
    ok, why = promote_decision(line)
    gate = next((v for k, v in sorted((line.get("yardstick") or {}).items()) if k.startswith(GATE)), None)
    if ok and gate is not None and gate["baseline_sha256"] != file_sha256(models / "model.safetensors"):
        ok, why = False, f"{why}; but it was compared with another shipped drafter: pass --yardstick again"
    if not ok:
        say("promote", f"not promoted: {why}")
        return False
    if not a.promote:
        say("promote", f"would export {unpacked / 'drafter'} over {models} and regenerate its model card's "
                       f"{CARD_HEADING!r} section ({why}); pass --promote to do it")  # fmt: skip
        return False
    card = models / "README.md"
    if not card.is_file():
        raise IngestError(f"{card}: missing: the model card's hand-written sections would be lost")
    text = card.read_text()
    shutil.copyfile(
        card, unpacked / "README.before-promotion.md"
    )  # the hand-written card, should export fail
    export(unpacked / "drafter", models, a.target)
    atomic_write_text(card, text)  # the export wrote its own README: the card comes back, its section below
    mark = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "models": str(models),
            "models_sha256": file_sha256(models / "model.safetensors")}  # fmt: skip
    atomic_write_text(unpacked / "promoted.json", json.dumps(mark, indent=1) + "\n")
    say("promote", f"exported {unpacked / 'drafter'} over {models} ({why})")
    return True


def write_card(models: Path, rows: list[dict[str, Any]]) -> None:
    card = models / "README.md"
    old = card.read_text()
    new = replace_section(old, campaign_section(rows))
    if new != old:
        atomic_write_text(card, new)
    say(
        "card",
        f"{card}: {CARD_HEADING!r} section {'regenerated' if new != old else 'unchanged'} ({len(rows)} stints)",
    )


# ----------------------------------------------------------------------------- 6. curve


# the curve's fit starts at the first stint of the recipe the campaign kept (greedy answers, training on from the
# last weights on every dataset kept so far); stints 1 and 2 trained on sampled answers and lost held-out τ
FIT_FROM_STINT = 3


def redraw_curve(stints: Path, png: Path) -> None:
    points = plot_learning_curve.curve(plot_learning_curve.read_rows(stints))
    plot_learning_curve.plot(points, png, FIT_FROM_STINT)
    say("curve", f"{png}: {len(points)} stints")


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "folder", type=Path, help="what a device call brought back: stint.json, bundle.tar.part*, SHA256"
    )
    p.add_argument(
        "--yardstick", action="append", type=Path, default=[], help="a frozen reference file (repeatable)"
    )
    p.add_argument(
        "--report", action="append", type=Path, default=[],
        help="a yardstick report.json made elsewhere (a GPU eval, the shipped drafter first; repeatable)",
    )  # fmt: skip
    p.add_argument("--report-drafter", default=None, help="the stint's drafter's name in the --report files")
    p.add_argument("--limit", type=int, default=None, help="yardstick prompts to evaluate (default: all)")
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads of the yardstick eval (default: all)"
    )
    p.add_argument(
        "--promote", action="store_true", help="export over --models when the paired test says better"
    )
    p.add_argument("--overwrite", action="store_true", help="replace this stint's earlier unpack and results")
    p.add_argument("--models", type=Path, default=MODELS, help="the shipped drafter's folder")
    p.add_argument("--target", default="default", help="the target of the yardstick eval and the export")
    p.add_argument("--data", type=Path, default=DATA, help="where bundles are unpacked (git-ignored)")
    p.add_argument("--results", type=Path, default=RESULTS, help="the campaign's results folder")
    return p.parse_args(argv)


def main(
    argv: list[str] | None = None, *, run_eval: EvalRunner = run_flashdraft, export: Exporter = export_shipped
) -> int:
    a = parse_args(argv)
    try:
        stint = read_stint(a.folder)
        k = stint["stint"]
        unpacked = unpack(a.folder, stint, a.data, a.overwrite)
        adopt_reports(a.report, a.report_drafter, unpacked, a.models, {f.stem for f in a.yardstick})
        yardstick(
            a.yardstick, unpacked, a.models, a, run_eval
        )  # (after: a clash with --report stops it first)
        write_results(small_files(unpacked) | data_pack(unpacked), a.results / f"stint-{k}", a.overwrite)
        stints = a.results / "stints.jsonl"
        rows = upsert(stints, stint_line(unpacked))
        if promote(next(r for r in rows if r["stint"] == k), unpacked, a, export) and a.promote:
            rows = upsert(stints, stint_line(unpacked))  # now with its "promoted" date
            write_card(a.models, rows)
        redraw_curve(stints, a.results / "learning_curve.png")
        return 0
    except IngestError as e:
        print(f"campaign_ingest: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

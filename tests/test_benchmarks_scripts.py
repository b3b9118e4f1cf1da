"""The GPU scripts' command lines, checked on CPU (benchmarks/gpu/README.md).

Each script runs with a recording `python3` first on PATH (it writes its arguments and exits 0), so nothing
is computed; every command line the script built is then parsed by the parser it is meant for — the real
typer CLI for `python3 -m flashdraft.cli …` (train overrides through the strict config loader too), the
benchmark's own argparse for `python3 benchmarks/<script>.py …`. A renamed option, a mistyped config key or
a path built from an unset folder fails here instead of on a GPU host.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
FD = ["-m", "flashdraft.cli"]


def run_script(tmp_path: Path, script: str, *args: str, **env: str) -> list[list[str]]:
    """Run benchmarks/gpu/`script` with a recording python3; the argument lists it passed, in order."""
    bin_dir, log = tmp_path / "bin", tmp_path / "argv.jsonl"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python3"
    # one line of output too, as a real run prints: the scripts filter it with grep, which fails on none
    record = "import json, os, sys; open(os.environ['ARGV_LOG'], 'a').write(json.dumps(sys.argv[1:]) + chr(10)); print('ran')"
    fake.write_text(f'#!/bin/sh\nexec "{sys.executable}" -c "{record}" "$@"\n')
    fake.chmod(0o755)
    full_env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "ARGV_LOG": str(log),
        "GPU_DIR": str(tmp_path / "gpu"),
        **env,
    }
    for k in ("STAGE", "WORK", "OUT"):  # the defaults of env.sh are under test, not the caller's folders
        if k not in env:
            full_env.pop(k, None)
    proc = subprocess.run(
        ["bash", f"benchmarks/gpu/{script}", *args], cwd=REPO, env=full_env, stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def parse_cli(args: list[str]) -> dict[str, Any]:
    """The parameters the real `flashdraft` CLI parses from `args` (subcommand words first), not run."""
    import typer

    from flashdraft.cli import app

    cmd = typer.main.get_command(app)
    i = 0
    while hasattr(cmd, "commands"):  # a group: descend by the subcommand words
        cmd, i = cmd.commands[args[i]], i + 1
    params = cmd.make_context(" ".join(args[:i]), list(args[i:])).params
    # paths as the strings the script wrote (typer hands Path options over as Path)
    return {k: ([str(x) if isinstance(x, Path) else x for x in v] if isinstance(v, (list, tuple)) else
                str(v) if isinstance(v, Path) else v) for k, v in params.items()}  # fmt: skip


class _Parsed(Exception):
    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns


def parse_script(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """`python3 benchmarks/X.py ARGS`: X's own argparse parses ARGS (unknown options fail); X does not run."""
    path = REPO / argv[0]
    monkeypatch.syspath_prepend(str(path.parent))  # as `python3 benchmarks/X.py` runs it: its folder first
    spec = importlib.util.spec_from_file_location(f"_script_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    original = argparse.ArgumentParser.parse_args

    def stop_after_parsing(self: argparse.ArgumentParser, *a: Any, **k: Any) -> argparse.Namespace:
        raise _Parsed(original(self, *a, **k))

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", stop_after_parsing)
        m.setattr(sys, "argv", [str(path), *argv[1:]])
        with pytest.raises(_Parsed) as parsed:
            module.main()
    return parsed.value.ns


def test_call2_data_regenerates_with_the_staged_prompts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = run_script(tmp_path, "call2_data.sh", MAX_TURNS="1", TEMPERATURE="0.8", SEED="3", REGEN_MIN="2.8")
    stage, work = tmp_path / "gpu" / "stage", tmp_path / "gpu" / "work"
    bench, regen = calls[0], calls[1]
    assert bench[0] == "benchmarks/regen_throughput.py"
    ns = parse_script(bench, monkeypatch)
    assert ns.input == f"sharegpt:{stage}/sharegpt_compact.json.gz" and (ns.batch_size, ns.n) == (512, 512)
    assert regen[:2] == FD
    p = parse_cli(regen[2:])
    assert p["input"] == [f"sharegpt:{stage}/sharegpt_compact.json.gz"] and p["out"] == str(work / "data")
    assert (p["engine"], p["device"], p["dtype"], p["batch_size"]) == ("native", "cuda", "bfloat16", 512)
    assert (p["max_turns"], p["temperature"], p["seed"], p["time_limit"]) == (1, 0.8, 3, 2.8)
    assert p["contamination"] == [f"humaneval:{stage}/HumanEval.jsonl.gz"]
    assert len(calls) == 2  # SKIP_BENCH unset: the throughput benchmark, then the regeneration


def test_call3_train_overrides_load_as_a_train_config(tmp_path: Path) -> None:
    from flashdraft.config import load_config
    from flashdraft.train.config import TrainConfig

    work = tmp_path / "gpu" / "work"
    calls = run_script(
        tmp_path,
        "call3_train.sh",
        "2200",
        INIT_FROM="models/smollm2-135m-instruct-dflash-b16",
        TRAIN_MIN="6.0",
    )
    train = [c for c in calls if c[:2] == FD]
    assert len(train) == 1  # the fake trainer exits 0: no fallback run
    p = parse_cli(train[0][2:])
    assert p["config"] == "configs/smollm2-b16.yaml" and not p["resume"]
    cfg = load_config(TrainConfig, REPO / p["config"], list(p["overrides"]))  # strict: an unknown key fails
    assert (cfg.run_dir, cfg.data.dataset, cfg.optim.max_steps) == (
        str(work / "run"),
        str(work / "data"),
        2200,
    )
    assert cfg.model.init_from == "models/smollm2-135m-instruct-dflash-b16"
    assert (cfg.runtime.compile, cfg.data.blocks_per_row, cfg.runtime.time_limit_min) == (
        "model,loss",
        1024,
        6.0,
    )
    assert cfg.model.target == str(tmp_path / "gpu" / "stage" / "SmolLM2-135M-Instruct.Q4_1.gguf")

    # a second invocation resumes the same run; DATA picks another dataset
    (work / "run" / "checkpoints" / "step-00000200").mkdir(parents=True)
    (tmp_path / "argv.jsonl").unlink()
    calls = run_script(tmp_path, "call3_train.sh", "2200", DATA=str(tmp_path / "merged"))
    p = parse_cli(next(c for c in calls if c[:2] == FD)[2:])
    assert p["resume"]
    assert load_config(TrainConfig, REPO / p["config"], list(p["overrides"])).data.dataset == str(
        tmp_path / "merged"
    )


def test_call5_eval_runs_the_three_evals_and_decode_speed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work, stage = tmp_path / "gpu" / "work", tmp_path / "gpu" / "stage"
    calls = run_script(tmp_path, "call5_eval.sh", DECODE="1", PROMPTS_N="3")
    evals = [parse_cli(c[2:]) for c in calls if c[:2] == FD]
    assert [e["out"] for e in evals] == [
        str(work / "evals" / n) for n in ("humaneval48", "sharegpt-heldout40", "humaneval16-t1")
    ]
    held_out = evals[1]["dataset"]
    assert held_out == "benchmarks/results/h200-2026-12-02-sharegpt-heldout-split"
    assert (REPO / held_out / "manifest.json").is_file()  # the held-out split the figures were measured on
    for e in evals:
        assert e["target"] == str(work / "smollm2-fp32") and (e["device"], e["dtype"]) == ("cuda", "float32")
        assert e["drafter"] == ["models/smollm2-135m-instruct-dflash-b16", str(work / "drafter-bf16")]
    assert (evals[0]["limit"], evals[0]["max_new_tokens"], evals[0]["budgets"], evals[0]["topk"]) == (
        48,
        256,
        "8,16,32,64,128,256,512",
        "8",
    )
    assert evals[2]["temperature"] == 1.0 and evals[0]["dataset"] == f"humaneval:{stage}/HumanEval.jsonl.gz"
    saves = [c for c in calls if c[0] == "benchmarks/gpu/save_target.py"]
    assert saves == [
        [
            "benchmarks/gpu/save_target.py",
            str(stage / "SmolLM2-135M-Instruct.Q4_1.gguf"),
            str(work / "smollm2-fp32"),
            "float32",
        ]
    ]
    decode = next(c for c in calls if c[0] == "benchmarks/decode_speed.py")
    ns = parse_script(decode, monkeypatch)
    assert (ns.drafter, ns.prompts, ns.max_new_tokens) == (str(work / "drafter-bf16"), 3, 256)


def test_call4_measure_and_compare_compile_parse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = run_script(tmp_path, "call4_measure.sh")
    assert [c[0] for c in calls] == ["benchmarks/decode_speed.py"] * 2
    t0, t1 = (parse_script(c, monkeypatch) for c in calls)
    assert t0.drafter == str(tmp_path / "gpu" / "work" / "drafter-bf16") and t1.temperature == 1.0
    (tmp_path / "argv.jsonl").unlink()
    calls = run_script(tmp_path, "compare_compile.sh")
    assert [c[0] for c in calls] == ["benchmarks/train_throughput.py"] * 3
    assert [parse_script(c, monkeypatch).compile for c in calls] == [
        "attention",
        "attention,loss",
        "model,loss",
    ]


def test_mfu_ab_variants_parse_and_target_the_staged_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "gpu" / "work"
    (work / "smollm2-bf16").mkdir(
        parents=True
    )  # what stage.sh saves; without it the script picks random weights
    variants = "base fused chunk8k flex128x64 all allht all1t"
    calls = run_script(tmp_path, "mfu_ab.sh", VARIANTS=variants, TOTAL_S="600")
    runs = [c for c in calls if c and c[0] == "benchmarks/train_throughput.py"]
    assert len(runs) == len(variants.split())
    parsed = [parse_script(c, monkeypatch) for c in runs]
    assert all(ns.target == str(work / "smollm2-bf16") and ns.compile == "model,loss" for ns in parsed)
    assert [ns.fused_ce for ns in parsed] == [False, True, True, False, True, True, True]


def test_stage_uses_the_repository_helpers(tmp_path: Path) -> None:
    """stage.sh joins the GGUF with parts.sh (sha256 checked) and saves the bf16 copy in $WORK."""
    data = os.urandom(5 * 2**19)  # 2.5 MiB: three 1-MiB parts
    parts = tmp_path / "parts"
    src = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    src.write_bytes(data)
    subprocess.run(
        ["bash", "benchmarks/gpu/parts.sh", "split", str(src), str(parts), "1"], cwd=REPO, check=True
    )
    stage = tmp_path / "gpu" / "stage"
    stage.mkdir(parents=True)
    for p in parts.iterdir():
        (stage / p.name).write_bytes(p.read_bytes())
    n = len(list(parts.glob("*.part*")))
    assert n > 1
    (stage / "PARTS").write_text(f"{n}\n")
    # an empty make_stage.py folder: a checkout's own .stage/ (ignored by git) must not leak into the test
    calls = run_script(tmp_path, "stage.sh", STAGE_FROM=str(tmp_path / "no-stage"))
    assert (stage / src.name).read_bytes() == data
    gguf, work = stage / src.name, tmp_path / "gpu" / "work"
    assert calls == [["benchmarks/gpu/save_target.py", str(gguf), str(work / "smollm2-bf16"), "bfloat16"]]

    # a corrupted part is refused by the checksum
    (stage / src.name).unlink()
    first = sorted(stage.glob("*.part*"))[0]
    first.write_bytes(b"x" + first.read_bytes()[1:])
    out = subprocess.run(
        ["bash", "benchmarks/gpu/parts.sh", "join", str(tmp_path / "j"), *map(str, sorted(stage.glob("*.part*")))],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 1 and "checksum mismatch" in out.stderr and not (tmp_path / "j").exists()


def test_make_stage_packs_files_first_fit_and_stages_every_campaign_pack_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ms = _load_script(REPO / "benchmarks/gpu/make_stage.py", monkeypatch)
    files = []
    for name, size in (("a", 50), ("b", 30), ("c", 20), ("d", 15), ("e", 40)):
        (tmp_path / name).write_bytes(b"x" * size)
        files.append(tmp_path / name)
    bins = [[files[0]]]  # a folder the other files filled first
    ms.first_fit(files[1:], 64, bins)
    assert [[f.name for f in b] for b in bins] == [["a"], ["b", "c"], ["d", "e"]]
    for k in (10, 8, 9):
        pack = tmp_path / "benchmarks/results/campaign" / f"stint-{k}" / "new-data.fdpack"
        pack.parent.mkdir(parents=True)
        pack.write_bytes(b"")
    monkeypatch.setattr(ms, "ROOT", tmp_path)
    assert [k for k, _ in ms.campaign_packs()] == [8, 9, 10]  # by stint, not by name
    # the tree slimmed for the calls (slim_tree.sh aside DIR): the packs are found where results/ was set aside
    (tmp_path / "aside").mkdir()
    (tmp_path / "benchmarks/results").rename(tmp_path / "aside/results")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git/slim_tree_aside").write_text(f"{tmp_path / 'aside'}\n")
    campaign = tmp_path / "aside/results/campaign"
    assert ms.campaign_packs() == [(k, campaign / f"stint-{k}/new-data.fdpack") for k in (8, 9, 10)]


def test_schedule_parts_trains_one_schedule_two_rewarmed_runs_and_two_parts_then_evaluates_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sp = _load_script(REPO / "benchmarks/schedule_parts.py", monkeypatch)
    ran: list[list[str]] = []

    def fake_run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
        ran.append(cmd)
        over = dict(x.split("=", 1) for x in cmd if "=" in x and not x.startswith("-"))
        if cmd[3] == "train":
            step = int(over["optim.max_steps"])
            (Path(over["run_dir"]) / "checkpoints" / f"step-{step:08d}" / "drafter").mkdir(parents=True)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(sp.subprocess, "run", fake_run)
    out, runs = tmp_path / "out", tmp_path / "runs"
    monkeypatch.setattr(sys, "argv", ["x", "--work", str(tmp_path / "qs"), "--steps", "10", "--runs", str(runs),
                                      "--out", str(out)])  # fmt: skip
    sp.main()
    trains = [dict(x.split("=", 1) for x in c if "=" in x and not x.startswith("-")) for c in ran[:5]]
    names = ("whole", "first-half", "rewarm", "parts-1", "parts")
    assert [t["run_dir"] for t in trains] == [str(runs / n) for n in names]
    assert [int(t["optim.max_steps"]) for t in trains] == [20, 10, 10, 10, 10]
    assert [t.get("optim.schedule_steps") for t in trains] == [None, None, None, "20", "20"]
    assert [t.get("optim.schedule_start") for t in trains] == [None, None, None, None, "10"]
    assert trains[2]["model.init_from"] == str(runs / "first-half/checkpoints/step-00000010/drafter")
    assert trains[4]["model.init_from"] == str(runs / "parts-1/checkpoints/step-00000010/drafter")
    assert trains[2]["runtime.seed"] == trains[4]["runtime.seed"] == "1" and "runtime.seed" not in trains[0]
    assert all(t["optim.ema_decay"] == "0.0" and "runtime.time_limit_min" not in t for t in trains)
    evaluated = [ran[5][i + 1] for i, x in enumerate(ran[5]) if x == "--drafter"]
    assert ran[5][3] == "eval" and [Path(d).parts[-4] for d in evaluated] == ["whole", "rewarm", "parts"]
    assert json.loads((out / "train_seconds.json").read_text())["steps_per_half"] == 10
    with pytest.raises(SystemExit, match="exists"):
        sp.main()  # the runs folder is there now: no run resumes another


def test_compare_references_finds_where_batched_references_part_and_pairs_tau(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from flashdraft.eval.references import Reference, _write

    cr = _load_script(REPO / "benchmarks/yardstick/compare_references.py", monkeypatch)
    head = {"format": "flashdraft-frozen-references/1", "target": "t", "target_fingerprint": "f", "dtype": "float32",
            "max_new_tokens": 8, "temperature": 0.0, "stop_token_ids": [0]}  # fmt: skip
    exact = [("a", [1, 2], [5, 6, 7]), ("b", [3], [8, 9, 10, 11]), ("c", [4], [12])]
    frozen = tmp_path / "exact.jsonl"
    frozen.write_text("".join(json.dumps({**head, "id": i, "prompt_ids": p, "tokens": t, "stop_reason": "length"})
                              + "\n" for i, p, t in exact))  # fmt: skip
    cache = tmp_path / "cache"
    batched = {"a": [5, 6, 7], "b": [8, 9, 4, 4], "c": [12]}

    def cached(name: str, **fields: Any) -> None:  # as the reference cache writes an entry
        ref = Reference(**{"template": "t", "source": "local-native", "temperature": 0.0, "seed": None,
                           "stop_reason": "length", "key": name, **fields})  # fmt: skip
        _write(cache / name[:2] / f"{name}.json", ref)

    for n, (i, p, _) in enumerate(exact):  # c's reference again with another prompt: not c's
        cached(f"{n:02d}key", id=i, prompt_ids=p if i != "c" else [99], tokens=batched[i])
    reports = []
    for name, taus in (("computed", [2.0, 3.0]), ("frozen", [2.0, 3.5])):
        per = [{"id": i, "tau": {"chain": t, "ddtree-8": 1.5}} for i, t in zip("ab", taus, strict=True)]
        reports.append(tmp_path / f"{name}.json")
        reports[-1].write_text(json.dumps({"drafters": {"d": {"per_sample": per}}}))
    out = tmp_path / "cmp.json"
    monkeypatch.setattr(sys, "argv", ["x", "--frozen", str(frozen), "--cache", str(cache), "--reports",
                                      *map(str, reports), "--json", str(out)])  # fmt: skip
    cr.main()
    result = json.loads(out.read_text())
    assert result["tokens"]["equal"] == 1 and result["tokens"]["missing"] == ["c"]
    assert result["tokens"]["parted"] == [
        {"id": "b", "first_difference": 2, "exact_tokens": 4, "batched_tokens": 4}
    ]
    assert result["tau"]["chain"] == {"prompts": 2, "differ": 1, "max_abs": 0.5, "mean": 0.25}
    assert result["tau"]["ddtree-8"]["differ"] == 0
    assert "1 of 3 prompts token-identical" in capsys.readouterr().out
    cached("02key", id="a", prompt_ids=[1, 2], tokens=[5, 6, 0])
    with pytest.raises(SystemExit, match="two greedy references of prompt a"):
        cr.main()


def test_compiled_kernels_lists_what_a_longer_forward_launches_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """benchmarks/compiled_kernels.py on one random SmolLM2-shaped layer (inductor's CPU code, ~15 s): both query
    lengths compile, every matmul and the attention are found, and the 16-token forward's one extra kernel is named."""
    ck = _load_script(REPO / "benchmarks/compiled_kernels.py", monkeypatch)
    code = "\n".join([
        "        buf3 = torch.ops.aten._scaled_dot_product_efficient_attention.default(buf1, buf2)",
        "        triton_poi_fused_add_0.run(buf0, stream=stream0)", "        extern_kernels.mm(buf1, buf2, out=buf3)",
        "        cpp_fused_clone_transpose_view_2(buf1)", "        del buf3",
    ])  # fmt: skip
    assert [ck.kernel_name(c) for c in ck.LAUNCH.findall(code)] == [
        "torch.ops.aten._scaled_dot_product_efficient_attention.default", "triton_poi_fused_add",
        "extern_kernels.mm", "cpp_fused_clone_transpose_view",
    ]  # fmt: skip
    out = tmp_path / "k.json"
    monkeypatch.setattr(sys, "argv", ["x", "--layers", "1", "--q", "1,16", "--json", str(out)])
    ck.main()
    launches = json.loads(out.read_text())["launches"]
    # the matmuls: q/k/v, o, gate/up, down, the head
    assert launches["1"]["extern_kernels.mm"] == launches["16"]["extern_kernels.mm"] == 5
    assert sum(launches["16"].values()) > sum(launches["1"].values())
    assert "| 16 |" in capsys.readouterr().out


def _load_script(path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(path.parent))
    spec = importlib.util.spec_from_file_location(f"_script_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_forward_speed_smoke_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/gpu/forward_speed.py --device cpu on a 2-layer random target: every engine, every stage, the
    JSON; the compiled target (inductor's CPU backend, 2 shapes: ~1-2 minutes on 2 cores) agrees with eager."""
    bench = _load_script(REPO / "benchmarks" / "gpu" / "forward_speed.py", monkeypatch)
    import random_targets  # benchmarks/, on the path the script put it

    monkeypatch.setitem(random_targets.SHAPES["random-tiny"], "num_hidden_layers", 2)
    out = tmp_path / "forward_speed.json"
    argv = ["random-tiny", "--device", "cpu", "--block", "4", "--drafter-layers", "1", "--budget", "3",
            "--prompts", "2", "--max-new-tokens", "10", "--reps", "2", "--out", str(out)]  # fmt: skip
    res = bench.main(argv)
    variants = ("eager", "compiled", "compiled-drafter", "compiled-overlap", "compiled-separate")
    assert json.loads(out.read_text())["variants"].keys() == set(variants)
    from flashdraft.decode.native import fuse_projections

    assert bench.native_forward.fuse_projections is fuse_projections  # patched out for its engine only
    for v in variants:
        ph = res["variants"][v]["phases"]
        assert all(
            ph[k] > 0
            for k in ("ar_step_ms", "verify_chain_q4_ms", "tree_b3_ms", "verify_tree_q4_ms", "draft_ms")
        )
        assert set(res["variants"][v]["rounds"]) == {"ar", "chain", "ddtree-3"}
        assert res["variants"][v]["rounds"]["chain"]["round_ms"]["verify"] > 0
        assert res["variants"][v]["rounds"]["chain"]["timed_round_ms"] > 0
    cmp = res["compiled_vs_eager"]
    assert cmp["ar_identical_sequences"] == cmp["of"] == 2
    for v in variants:  # the same graphs at the same state: the same tokens
        assert all(res["variants"][v]["stale_rows_identical"].values())
        for row in res["variants"][v]["rounds"].values():
            assert row["rerun_vs_timed"]["identical"] == row["profiled_vs_timed"]["identical"] == 2
    tf = cmp["teacher_forced"]
    assert tf["positions"] > 0 and tf["argmax_agree_frac"] == 1.0 and tf["max_abs_dlogit"] < 1e-3
    with pytest.raises(SystemExit, match="--overwrite"):  # never replaces a file it did not write
        bench.main(argv)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_regen_step_smoke_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/gpu/regen_step.py --device cpu: every variant's step timed and compared with sdpa's (float32:
    the same argmax), both attentions end to end with the same ids, and the pick."""
    bench = _load_script(REPO / "benchmarks" / "gpu" / "regen_step.py", monkeypatch)
    import random_targets  # benchmarks/, on the path the script put it

    import flashdraft.data.native as native

    monkeypatch.setitem(random_targets.SHAPES["random-tiny"], "num_hidden_layers", 2)
    monkeypatch.setattr(native, "varlen_support_error", lambda *a: None)  # the flash kernel by its definition
    monkeypatch.setattr(native, "varlen_attention", native.varlen_reference)
    out = tmp_path / "regen_step.json"
    argv = ["random-tiny", "--device", "cpu", "--rows", "3", "--spans", "256", "--reps", "1", "--prompts", "4",
            "--max-prompt", "140", "--new", "5", "--out", str(out)]  # fmt: skip
    res = bench.main(argv)
    assert json.loads(out.read_text()) == res
    assert [r["variant"] for r in res["steps"]] == ["sdpa", "varlen", "flex", "no-attention"]
    for row in res["steps"][1:3]:
        assert row["argmax_agree"] == 1.0 and row["max_abs_dlogit"] < 1e-4
    assert [r["attention"] for r in res["generate"]] == ["sdpa", "varlen"]
    assert res["generate"][1]["same_ids_as_sdpa"] == 4 and res["generate"][0]["tokens"] == 20
    assert res["pick"] in ("sdpa", "varlen")
    fast = {"steps": [{"span": 8, "variant": "varlen", "argmax_agree": 1.0}], "generate": [
        {"attention": "sdpa", "tok_s": 100}, {"attention": "varlen", "tok_s": 106}]}  # fmt: skip
    assert bench.pick(fast) == "varlen"
    assert bench.pick({**fast, "steps": [{"span": 8, "variant": "varlen", "argmax_agree": 0.9}]}) == "sdpa"
    # the bar is how often SDPA's own exact kernels agree with it (bf16 near-ties), less one point, per span
    exact = [{"span": 8, "variant": "sdpa:efficient", "argmax_agree": 0.92},
             {"span": 8, "variant": "sdpa:math", "argmax_agree": 0.915}]  # fmt: skip
    varlen = lambda agree: {"span": 8, "variant": "varlen", "argmax_agree": agree}  # noqa: E731
    assert bench.pick({**fast, "steps": [*exact, varlen(0.91)]}) == "varlen"
    assert bench.pick({**fast, "steps": [*exact, varlen(0.90)]}) == "sdpa"
    other_span = {"span": 16, "variant": "varlen", "argmax_agree": 0.91}  # no exact kernel there: 99% holds
    assert bench.pick({**fast, "steps": [*exact, fast["steps"][0], other_span]}) == "sdpa"
    fast["generate"][1]["tok_s"] = 104  # under 5% faster: not worth a change
    assert bench.pick(fast) == "sdpa"
    with pytest.raises(SystemExit, match="--overwrite"):
        bench.main(argv)
    # --compiled: the step through torch.compile beside the eager one, the same logits (float32)
    step_only = [*argv[:9], "--prompts", "0", "--compiled", "sdpa", "--out", str(tmp_path / "c.json")]
    res = bench.main(step_only)
    row = next(r for r in res["steps"] if r["variant"] == "sdpa+compile")
    assert row["max_abs_dlogit"] < 1e-4 and row["argmax_agree"] == 1.0 and res["generate"] == []


def _small_engine() -> Any:
    """An eager FastEngine (CPU, float64) over a 2-layer tiny target and a block-4 drafter: fast."""
    from flashdraft.decode.engine import FastEngine
    from tests.conftest import tiny_drafter, tiny_target

    target = tiny_target("llama", layers=2, seed=5)
    return FastEngine(target, tiny_drafter(target, layers=1, block_size=4), max_len=48, max_budget=3)


def test_forward_speed_records_where_a_profiled_run_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    """forward_speed.py's rounds: a profiled run whose tokens differ from the timed run's is recorded (token index,
    both tokens, the eager target's top-2 margin there) and shown in the table, where an assert ended the variant."""
    import torch

    bench = _load_script(REPO / "benchmarks" / "gpu" / "forward_speed.py", monkeypatch)
    engine = _small_engine()
    real = engine.generate

    def generate(ids: list[int], *, profile: bool = False, **kw: Any) -> Any:
        res = real(ids, profile=profile, **kw)
        if profile:  # a profiled run that breaks a tie the other way at token 5
            res.tokens[5] = (res.tokens[5] + 1) % engine.target.vocab_size
        return res

    monkeypatch.setattr(engine, "generate", generate)
    prompts = [[5, 9, 11], [7, 3, 20, 8]]
    out = bench.rounds(engine, prompts, 3, 10, "cpu")
    for name in ("ar", "chain", "ddtree-3"):
        assert out[name]["rerun_vs_timed"] == {"identical": 2, "of": 2, "divergences": []}
        prof = out[name]["profiled_vs_timed"]
        assert prof["identical"] == 0 and [(d["prompt"], d["index"]) for d in prof["divergences"]] == [
            (0, 5),
            (1, 5),
        ]
        seq = out[name]["sequences"][0]
        ref = engine.target.forward(torch.tensor([prompts[0] + seq[:5]])).logits[0, -1]  # predicts token 5
        top2 = ref.topk(2).values
        d = prof["divergences"][0]
        assert (d["a"], d["b"], d["eager_argmax"]) == (seq[5], (seq[5] + 1) % 97, int(ref.argmax()))
        assert d["eager_top2_margin"] == pytest.approx(float(top2[0] - top2[1]), abs=1e-9)
        assert d["gap_a_minus_b"] == pytest.approx(float(ref[d["a"]] - ref[d["b"]]), abs=1e-9)
    margin = out["ar"]["profiled_vs_timed"]["divergences"][0]["eager_top2_margin"]
    results = {
        "variants": {"compiled": {"phases": {}, "rounds": out, "stale_rows_identical": {"ar_step": True}}}
    }
    lines = bench.table(results, 3, 4)
    assert f"| ar profiled = timed | 0/2 @5 Δ{margin:.3f} |" in lines
    assert "| ar rerun = timed | 2/2 |" in lines
    assert "| target phases ignore stale cache rows | True |" in lines


def test_forward_speed_stale_rows_probe_catches_a_phase_reading_stale_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe: the engine's phases give the same K/V rows, features and choices whatever the cache holds past the
    committed length; a target forward that also reads the (never written) last cache row is caught."""
    from flashdraft.decode.native import NativeOutput

    bench = _load_script(REPO / "benchmarks" / "gpu" / "forward_speed.py", monkeypatch)
    engine = _small_engine()
    engine.warmup([("ar", None), ("chain", None), ("ddtree", 3)])
    engine.generate([5, 9, 11], max_new_tokens=2, method="chain")
    seq_len = int(engine.seq_len)
    assert bench.stale_rows_probe(engine, 3) == {"ar_step": True, "verify_chain": True, "verify_tree": True}
    assert int(engine.seq_len) == seq_len
    real = engine.native.forward

    def leaky(*args: Any, **kw: Any) -> NativeOutput:
        out = real(*args, **kw)
        extra = engine.native.cache[..., -1, :].sum()
        return NativeOutput(out.logits, None if out.features is None else out.features + extra)

    monkeypatch.setattr(engine.native, "forward", leaky)
    assert bench.stale_rows_probe(engine, 3) == {"ar_step": True, "verify_chain": False, "verify_tree": False}


def test_call6_fast_paths_times_the_forward_and_benches_auto(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, stage = tmp_path / "gpu" / "out", tmp_path / "gpu" / "stage"
    calls = run_script(tmp_path, "call6_fast_paths.sh", TAU_REPORT="r.json")
    assert calls[0][0] == "benchmarks/gpu/forward_speed.py"
    ns = parse_script(calls[0], monkeypatch)
    assert (ns.prompts, ns.max_new_tokens, ns.budget, str(ns.out)) == (
        3,
        128,
        32,
        str(out / "forward_speed.json"),
    )
    bench = parse_cli(calls[1][2:])
    assert calls[1][:3] == [*FD, "bench"] and bench["methods"].split(",")[:3] == ["ar", "auto", "chain"]
    assert (bench["device"], bench["dtype"], bench["max_new_tokens"]) == ("cuda", "bfloat16", 256)
    assert bench["tau_report"] == "r.json" and bench["dataset"] == f"humaneval:{stage}/HumanEval.jsonl.gz"
    assert bench["out"] == str(out / "bench")


def test_call8_round_cost_times_rounds_at_both_cache_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "gpu" / "out"
    calls = run_script(tmp_path, "call8_round_cost.sh", DRAFTER="d")
    assert [c[0] for c in calls[:3]] == [
        "benchmarks/gqa_attention.py", "benchmarks/engine_spans.py", "benchmarks/gpu/forward_speed.py",
    ]  # fmt: skip
    spans, big = (parse_script(c, monkeypatch) for c in calls[1:3])
    assert (spans.device, spans.dtype, spans.drafter, str(spans.out)) == (
        "cuda", "bfloat16", "d", str(out / "engine_spans.json")
    )  # fmt: skip
    assert (big.max_len, big.max_budget, big.drafter, str(big.out)) == (
        2048, 512, "d", str(out / "forward_speed_bench.json")
    )  # fmt: skip
    benches = [parse_cli(c[2:]) for c in calls[3:]]
    assert [b["compile"] for b in benches] == [False, True]
    assert all(b["methods"] == "ar,chain,ddtree:32" and b["limit"] == 8 for b in benches)
    assert [b["out"] for b in benches] == [str(out / "bench_fast"), str(out / "bench_compiled")]


def test_call7_stint_eval_scores_both_drafters_and_sends_one_tar(tmp_path: Path) -> None:
    out, stage, work = tmp_path / "gpu" / "out", tmp_path / "gpu" / "stage", tmp_path / "gpu" / "work"
    calls = run_script(tmp_path, "call7_stint_eval.sh", NEW="new-drafter")
    evals = [parse_cli(c[2:]) for c in calls if c[:3] == [*FD, "eval"]]
    assert [e["out"] for e in evals] == [str(out / "evals" / n) for n in
                                         ("humaneval-164", "sharegpt-heldout-100", "humaneval-164-t1")]  # fmt: skip
    for e in evals:
        assert e["drafter"] == ["models/smollm2-135m-instruct-dflash-b16", "new-drafter"]
        assert (e["target"], e["device"], e["dtype"]) == (str(work / "smollm2-fp32"), "cuda", "float32")
    assert evals[0]["references"] == "benchmarks/yardstick/humaneval-164.jsonl"
    assert (evals[2]["temperature"], evals[2]["limit"]) == (1.0, 32)
    assert evals[2]["dataset"] == f"humaneval:{stage}/HumanEval.jsonl.gz"
    bench = parse_cli(calls[-1][2:])
    assert calls[-1][:3] == [*FD, "bench"] and bench["tau_report"] == str(
        out / "evals/humaneval-164/report.json"
    )
    assert not any(c[0] == "benchmarks/eval_tree_walks.py" for c in calls)  # only with WALKS
    # a device call sends back at most 8 files: the log and one tar
    assert sorted(p.name for p in out.iterdir()) == ["stint_eval.log", "stint_eval.tar"]


def test_call7_with_walks_times_the_replay_walks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = run_script(tmp_path, "call7_stint_eval.sh", NEW="new-drafter", WALKS="164")
    assert calls[-1][0] == "benchmarks/eval_tree_walks.py"
    ns = parse_script(calls[-1], monkeypatch)
    assert (ns.target, ns.drafter, ns.limit, ns.device) == (
        str(tmp_path / "gpu" / "work" / "smollm2-fp32"),
        "new-drafter",
        164,
        "cuda",
    )


def test_call7_benches_the_held_out_sharegpt_prompts_when_asked(tmp_path: Path) -> None:
    out = tmp_path / "gpu" / "out"
    calls = run_script(tmp_path, "call7_stint_eval.sh", NEW="new-drafter", BENCH_SHAREGPT="24")
    benches = [parse_cli(c[2:]) for c in calls if c[:3] == [*FD, "bench"]]
    assert len(benches) == 2 and benches[1]["dataset"] == "benchmarks/yardstick/sharegpt-heldout-100.jsonl"
    assert benches[1]["limit"] == 24 and "auto" in benches[1]["methods"].split(",")
    assert benches[1]["tau_report"] == str(out / "evals/sharegpt-heldout-100/report.json")
    assert benches[1]["out"] == str(out / "bench" / "sharegpt")


def test_call7_without_t1_and_bench_scores_only_the_yardstick(tmp_path: Path) -> None:
    """T1_LIMIT=0 BENCH_PROMPTS=0: the two yardstick evals alone (a call that trained first has room for no more)."""
    calls = run_script(tmp_path, "call7_stint_eval.sh", NEW="new-drafter", T1_LIMIT="0", BENCH_PROMPTS="0")
    evals = [parse_cli(c[2:]) for c in calls if c[:3] == [*FD, "eval"]]
    assert [Path(e["out"]).name for e in evals] == ["humaneval-164", "sharegpt-heldout-100"]
    assert not any(c[:3] == [*FD, "bench"] for c in calls)
    out = tmp_path / "gpu" / "out"
    assert sorted(p.name for p in out.iterdir()) == ["stint_eval.log", "stint_eval.tar"]


def test_call7_with_reuse_passes_each_yardstick_its_earlier_report(tmp_path: Path) -> None:
    """REUSE=FOLDER: `--reuse FOLDER/NAME/report.json` for each yardstick that has one there, none for the rest."""
    folder = tmp_path / "earlier"
    (folder / "humaneval-164").mkdir(parents=True)
    (folder / "humaneval-164" / "report.json").write_text("{}")
    calls = run_script(tmp_path, "call7_stint_eval.sh", NEW="new-drafter", REUSE=str(folder))
    evals = [parse_cli(c[2:]) for c in calls if c[:3] == [*FD, "eval"]]
    assert [e["reuse"] for e in evals] == [[str(folder / "humaneval-164" / "report.json")], [], []]


def test_regen_throughput_margins_at_first_differences(monkeypatch: pytest.MonkeyPatch) -> None:
    """regen_throughput.py's near-tie report: the target's top-2 margin where an output first departs from
    generate's (teacher-forced on the prompt and the shared prefix), outputs equal or only cut shorter skipped, at
    most `limit` of them."""
    import torch

    from tests.conftest import tiny_target

    bench = _load_script(REPO / "benchmarks" / "regen_throughput.py", monkeypatch)
    target = tiny_target("llama", layers=2, seed=3)
    prompts = [[5, 7, 9], [11, 2], [4, 4, 4, 8]]
    ref = [[3, 6, 1, 2], [8, 8], [1, 2, 3]]
    outs = [[3, 6, 5, 2], [8, 8], [1, 2]]  # the first differs at new token 2; the others do not differ
    res = bench.divergence_margins(target, prompts, outs, ref, limit=8)
    with torch.no_grad():
        logits = target.forward(torch.tensor([[5, 7, 9, 3, 6]]), logits="last").logits[0, -1]
    top2 = logits.float().topk(2).values
    assert res["checked"] == 1 and res["median"] == res["max"] == round(float(top2[0] - top2[1]), 4)
    two = bench.divergence_margins(
        target, prompts * 2, [outs[0], *outs[1:], outs[0], *outs[1:]], ref * 2, limit=1
    )
    assert two["checked"] == 1
    none = bench.divergence_margins(target, prompts, ref, ref, limit=8)
    assert none == {"checked": 0, "median": None, "p90": None, "max": None, "under_0.25": 0, "under_1": 0}

"""benchmarks/gpu/campaign_stint.py on a CPU: its command lines parse with the real CLI into a valid training
config, fresh data every stint, only ShareGPT trained on, the budget split, what one phase ships back."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from flashdraft.config import ConfigError, load_config
from flashdraft.drafter import DFlashDrafter
from flashdraft.train.config import TrainConfig
from flashdraft.train.launch import build_drafter
from tests.conftest import tiny_drafter, tiny_target
from tests.test_quickstart import _parse

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "campaign_stint", REPO / "benchmarks" / "gpu" / "campaign_stint.py"
)
cs = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["campaign_stint"] = cs  # dataclasses look their module up while the script is executed
_spec.loader.exec_module(cs)  # type: ignore[union-attr]

HE = "/st/HumanEval.jsonl.gz"


@pytest.fixture(autouse=True)
def _gpu_folders(monkeypatch: pytest.MonkeyPatch) -> None:
    """env.sh's folders, as the scripts see them on the CUDA host."""
    monkeypatch.setenv("STAGE", "/st")
    monkeypatch.setenv("WORK", "/wk")
    monkeypatch.delenv("TARGET", raising=False)


CONFIG_PATH = REPO / "configs" / "smollm2-b16.yaml"


def test_dry_run_regenerates_a_slice_of_the_conversations(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--stint", "7", "--temperature", "0", "--max-turns", "3", "--skip", "4096", "--limit", "6144",
            "--phases", "regen", "--work", "/w", "--dry-run"]  # fmt: skip
    assert cs.main(argv) == 0
    regen = _parse(json.loads(capsys.readouterr().out)["regen"])
    assert (regen["skip"], regen["limit"], regen["max_turns"], regen["temperature"]) == (4096, 6144, 3, 0.0)


def test_self_prompts_are_written_first_then_answered_alone(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--stint", "18", "--temperature", "0", "--max-turns", "1", "--self-prompts", "20000", "--self-opening",
            "Write a Python function that", "--self-opening", "", "--phases", "regen", "--work", "/w", "--dry-run"]  # fmt: skip
    assert cs.main(argv) == 0
    cmd = json.loads(capsys.readouterr().out)
    made = _parse(cmd["self-prompts"])
    assert (made["out"], made["n"], made["seed"], made["opening"]) == (
        "/w/self-prompts.jsonl.gz", 20000, cs.plan_for(18).seed, ["Write a Python function that", ""]
    )
    assert made["device"] == "cuda" and made["engine"] == "native" and made["overwrite"]
    regen = _parse(cmd["regen"])
    assert regen["input"] == ["prompts:/w/self-prompts.jsonl.gz"]  # no ShareGPT unless --input asks for it
    assert regen["contamination"] == [f"humaneval:{HE}"] and regen["temperature"] == 0.0


def test_dry_run_commands_parse_with_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--stint", "4", "--prev-data", "/c/prev", "--budget-min", "9.5", "--regen-min", "3", "--eval-min", "2",
            "--work", "/w", "--dry-run"]  # fmt: skip
    assert cs.main(argv) == 0
    cmd = json.loads(capsys.readouterr().out)
    plan = cs.plan_for(4)
    assert cmd["budget"] == {
        "regen": 3.0,
        "eval": 2.0,
        "train": 4.1,
    }  # training takes the rest, 0.4 min shipping
    regen = _parse(cmd["regen"])
    assert regen["input"] == ["sharegpt:/st/sharegpt_compact.json.gz"] and regen["out"] == "/w/new"
    assert regen["contamination"] == [f"humaneval:{HE}"]  # the HumanEval check on, with the staged copy
    assert (regen["seed"], regen["temperature"], regen["max_turns"]) == (
        plan.seed,
        plan.temperature,
        plan.max_turns,
    )
    assert regen["time_limit"] == 3.0 and regen["device"] == "cuda" and regen["engine"] == "native"
    assert regen["max_batch_tokens"] == 2_500_000 and regen["shard_size"] == 256 and regen["skip"] == 0
    assert regen["continue_from"] == [] and regen["limit"] is None
    assert regen["attention"] == "auto"  # varlen where its probe passes; --attention sdpa to pin the old step
    merge = _parse(cmd["merge"])
    assert merge["inputs"] == ["/c/prev", "/w/new"] and merge["out"] == "/w/data"
    assert merge["contamination"] == [f"humaneval:{HE}"]
    train = _parse(cmd["train"])
    cfg = load_config(TrainConfig, train["config"], train["overrides"])
    cfg.validate()
    assert cfg.runtime.feature_pass == "native" and cfg.runtime.compile_parts == {"model", "loss", "target", "target_graph"}
    assert cfg.model.init_from == "models/smollm2-135m-instruct-dflash-b16" and cfg.data.dataset == "/w/data"
    assert cfg.runtime.time_limit_min == 3.6 and cfg.runtime.fit_steps_to_time_limit  # 0.5 min start-up
    assert cfg.eval.every == 1000 and cfg.eval.dataset == f"humaneval:{HE}"
    assert not train["resume"]
    evals = [_parse(e) for e in cmd["eval"]]
    assert [(e["dataset"], e["limit"], e["dtype"]) for e in evals] == [
        (f"humaneval:{HE}", 48, "float32"),
        (str(REPO / "benchmarks/results/h200-2026-12-02-sharegpt-heldout-split"), 40, "float32"),
    ]
    assert all(e["drafter"] == [Path("/w/drafter-bf16")] for e in evals)


def test_a_later_call_trains_on_given_data_without_regeneration(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        cs.main(["--stint", "4", "--phases", "train", "--data", "/c/all", "--work", "/w", "--dry-run"]) == 0
    )
    cmd = json.loads(capsys.readouterr().out)
    assert (
        set(cmd) == {"plan", "budget", "train"} and cmd["budget"]["train"] == 8.6
    )  # 9.0 less 0.4 for shipping
    assert "data.dataset=/c/all" in cmd["train"]
    assert f"eval.dataset=humaneval:{HE}" in cmd["train"]
    args = cs.parse_args(["--stint", "4", "--val-references", "/c/refs.jsonl"])
    cfg = load_config(TrainConfig, CONFIG_PATH, cs.train_args(args, Path("/d"), Path("/r"), "m", 5.0)[2:])
    assert cfg.eval.references == "/c/refs.jsonl" and cfg.eval.dataset == ""
    cfg.validate()  # exactly one of eval.references and eval.dataset


def test_every_stint_samples_new_answers() -> None:
    plans = [cs.plan_for(k) for k in range(9)]
    assert len({(p.seed, p.temperature) for p in plans}) == 9  # sample ids "@T{t}s{seed}" never repeat
    assert {p.max_turns for p in plans} == {1, 2, 3} and all(p.temperature > 0 for p in plans)
    assert min(p.seed for p in plans) > 2  # the shipped drafter's data used seeds 0..2


@pytest.mark.parametrize(
    "spec", ["humaneval", f"humaneval:{HE}", "messages:chats.jsonl", "prompts:p.txt", "x.jsonl"]
)
def test_only_sharegpt_and_codeio_are_trained_on(spec: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cs.main(["--stint", "1", "--input", spec, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"campaign_stint: --input {spec}:")
    assert ("eval set" in err) if spec.startswith("humaneval") else ("standard library" in err)
    assert cs.check_training_input("sharegpt") == "sharegpt"
    assert cs.check_training_input("sharegpt:/s/x.json.gz") == "sharegpt:/s/x.json.gz"
    assert cs.check_training_input("sharegpt-turns:/s/x.json.gz") == "sharegpt-turns:/s/x.json.gz"
    assert cs.check_training_input("codeio:/s/codeio.jsonl.gz") == "codeio:/s/codeio.jsonl.gz"


def test_a_prompts_file_trains_only_when_its_bytes_were_reviewed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "Sort a list."}\n')
    with pytest.raises(cs.StintError, match="REVIEWED_PROMPT_FILES"):
        cs.check_training_input(f"prompts:{f}")
    monkeypatch.setitem(cs.REVIEWED_PROMPT_FILES, hashlib.sha256(f.read_bytes()).hexdigest(), "a test file")
    assert cs.check_training_input(f"prompts:{f}") == f"prompts:{f}"
    f.write_text('{"prompt": "Sort a list!"}\n')  # one byte changed: not the file that was reviewed
    with pytest.raises(cs.StintError, match="REVIEWED_PROMPT_FILES"):
        cs.check_training_input(f"prompts:{f}")


def test_budget_too_small_for_training_names_the_flags() -> None:
    assert cs.Budget.split(9.0, 3.0, 2.0) == cs.Budget(3.0, 2.0, 3.6)
    with pytest.raises(cs.StintError, match="lower --regen-min / --eval-min"):
        cs.Budget.split(4.5, 3.0, 1.0)


def test_init_from_a_drafter_folder_starts_from_its_weights(tmp_path: Path) -> None:
    t = tiny_target("llama", dtype=torch.float32)
    d = tiny_drafter(t, block_size=8)
    d.save_pretrained(tmp_path / "d")
    cfg = load_config(
        TrainConfig, None, ["data.dataset=x", "model.block_size=8", f"model.init_from={tmp_path / 'd'}"]
    )
    got = build_drafter(cfg, t, torch.device("cpu"), torch.float32)
    assert got.training and all(
        torch.equal(a, b) for a, b in zip(got.state_dict().values(), d.state_dict().values(), strict=True)
    )
    cfg.model.block_size = 16
    with pytest.raises(ConfigError, match="set model.block_size=8"):
        build_drafter(cfg, t, torch.device("cpu"), torch.float32)


def test_grow_layers_deepens_a_loaded_drafter(tmp_path: Path) -> None:
    t = tiny_target("llama", dtype=torch.float32)
    d = tiny_drafter(t, block_size=8)
    d.save_pretrained(tmp_path / "d")
    base = ["data.dataset=x", "model.block_size=8", f"model.init_from={tmp_path / 'd'}"]
    cfg = load_config(TrainConfig, None, [*base, "model.grow_layers=2"])
    got = build_drafter(cfg, t, torch.device("cpu"), torch.float32)
    n = d.config.num_hidden_layers
    assert got.training and got.config.num_hidden_layers == n + 2
    kept = {k: v for k, v in got.state_dict().items() if k in d.state_dict()}
    assert len(kept) == len(d.state_dict()) and all(torch.equal(v, d.state_dict()[k]) for k, v in kept.items())
    again = build_drafter(cfg, t, torch.device("cpu"), torch.float32)  # seeded: a resumed run builds the same
    assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(), again.state_dict().values(), strict=True))


def _manifest(path: Path, samples: int, loss: int) -> None:
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(
        json.dumps({"counts": {"train": samples}, "tokens": {"train": {"loss": loss}}})
    )


def test_ship_writes_the_summary_and_a_bundle_that_joins(tmp_path: Path) -> None:
    work, out = tmp_path / "w", tmp_path / "out"
    a = cs.parse_args(["--stint", "2", "--work", str(work), "--out", str(out)])
    st = cs.Stint(a)
    out.mkdir()
    _manifest(work / "new", 100, 40_000)
    _manifest(work / "data", 350, 150_000)
    ck = work / "train-1" / "checkpoints" / "step-00000020"
    tiny_drafter(tiny_target("llama", dtype=torch.float32), block_size=8).save_pretrained(ck / "drafter")
    lines = [{"step": 10, "step_time_s": 0.3, "val/chain_tau": 2.0}, {"step": 20, "step_time_s": 0.3, "loss": 1.0},
             {"step": 20, "val/chain_tau": 2.5, "val/ddtree_tau": 4.0, "val/seconds": 6.0}]  # fmt: skip
    (work / "train-1" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    rep = work / "eval" / "humaneval" / "report.json"
    rep.parent.mkdir(parents=True)
    rep.write_text(
        json.dumps(
            {
                "drafters": {
                    "d": {
                        "samples": 48,
                        "methods": {
                            "chain": {"tau": 3.1},
                            "ddtree-8": {"tau": 4.0},
                            "ddtree-512": {"tau": 5.2},
                            "topk-8": {"tau": 5.0},
                        },
                    }
                }
            }
        )
    )
    st.state.update(train_runs=["train-1"], minutes={"regen": 3.0, "train": 5.0}, calls=1)
    st.ship()
    s = json.loads((out / "stint.json").read_text())
    assert s["stint"] == 2 and s["train_minutes"] == 5.0 and s["train_steps"] == 20
    assert s["train_loop_minutes"] == 0.1 and s["val_minutes"] == 0.1  # 20 steps x 0.3 s; one 6 s validation
    assert s["new"] == {"samples": 100, "loss_tokens": 40_000} and s["cumulative"] == {
        "samples": 350,
        "loss_tokens": 150_000,
    }
    assert s["val"] == {"val/chain_tau": 2.5, "val/ddtree_tau": 4.0, "val/seconds": 6.0}
    assert s["eval"]["humaneval"] == {"prompts": 48, "chain_tau": 3.1, "ddtree_tau": 5.2, "ddtree_budget": "ddtree-512",
                                      "topk8_streak": 5.0}  # fmt: skip
    assert s["gpu_minutes"] >= 8.0 and s["plan"] == {
        "temperature": 1.0,
        "seed": 102,
        "max_turns": 3,
        "skip": 0,
    }
    parts = sorted(out.glob("bundle.tar.part*"))
    assert parts and (out / "SHA256").is_file() and len(list(out.iterdir())) <= 8
    joined = tmp_path / "bundle.tar"
    subprocess.run(
        ["bash", str(REPO / "benchmarks/gpu/parts.sh"), "join", str(joined), *map(str, parts)], check=True
    )
    want = (out / "SHA256").read_text().split()[0]
    assert (
        subprocess.run(["sha256sum", str(joined)], capture_output=True, text=True).stdout.split()[0] == want
    )
    with tarfile.open(joined) as tf:
        names = tf.getnames()
    assert {"drafter/config.json", "drafter/model.safetensors", "metrics.jsonl", "eval/humaneval/report.json",
            "new-data/manifest.json"} <= set(names)  # fmt: skip
    d = DFlashDrafter.from_pretrained(work / "drafter-bf16")
    assert next(d.parameters()).dtype == torch.bfloat16


_pspec = importlib.util.spec_from_file_location(
    "plot_learning_curve", REPO / "benchmarks" / "plot_learning_curve.py"
)
plc = importlib.util.module_from_spec(_pspec)  # type: ignore[arg-type]
sys.modules["plot_learning_curve"] = plc
_pspec.loader.exec_module(plc)  # type: ignore[union-attr]


def test_learning_curve_accumulates_minutes_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [
        {"stint": 2, "train_minutes": 25.0, "new": {"loss_tokens": 4_000_000},
         "eval": {"humaneval": {"chain_tau": 3.4, "ddtree_tau": 5.6}, "sharegpt": {"chain_tau": 3.1, "ddtree_tau": None}}},
        {"stint": 0, "train_minutes": 36.0, "new": {"loss_tokens": 13_070_000},
         "eval": {"humaneval": {"chain_tau": 3.0, "ddtree_tau": 5.0}}},
        {"stint": 1, "train_minutes": 20.0, "new": {"loss_tokens": 3_930_000},
         "val": {"val/chain_tau": 3.2, "val/ddtree_tau": 5.3}},
    ]  # fmt: skip
    f = tmp_path / "stints.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pts = plc.curve(plc.read_rows(f))
    assert [(p.stint, p.train_minutes, p.loss_tokens) for p in pts] == [
        (0, 36.0, 13_070_000), (1, 56.0, 17_000_000), (2, 81.0, 21_000_000)]  # fmt: skip
    assert pts[1].tau == {"val": (3.2, 5.3)} and pts[2].tau["sharegpt"] == (3.1, None)
    plc.main([str(f), "--out", str(tmp_path / "c.png"), "--table"])
    text = capsys.readouterr().out
    assert "| 2 | 81.0 | 21.00M | 3.40 / 5.60 | 3.10 / - | - |" in text
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_later_call_trains_from_the_last_call_s_weights_and_references(tmp_path: Path) -> None:
    st = cs.Stint(cs.parse_args(["--stint", "5", "--work", str(tmp_path), "--out", str(tmp_path / "out")]))
    ck = tmp_path / "train-1" / "checkpoints" / "step-00000400"
    (ck / "drafter").mkdir(parents=True)
    (tmp_path / "train-1" / "val_references.jsonl").write_text("{}\n")
    st.state["train_runs"] = ["train-1"]
    ran: list[list[str]] = []
    st.run = lambda phase, args, timeout_min: ran.append(args) or 0  # type: ignore[method-assign]
    st.train(6.0)
    train = _parse(ran[0])
    assert f"run_dir={tmp_path / 'train-2'}" in train["overrides"]
    assert f"model.init_from={ck / 'drafter'}" in train["overrides"]
    cfg = load_config(TrainConfig, train["config"], train["overrides"])
    assert cfg.eval.references == str(tmp_path / "train-1" / "val_references.jsonl") and not cfg.eval.dataset
    assert st.state["train_runs"] == ["train-1", "train-2"]


def test_a_stint_trains_its_part_of_one_long_schedule_and_records_where_it_ended(tmp_path: Path) -> None:
    argv = ["--stint", "5", "--work", str(tmp_path), "--out", str(tmp_path / "out"), "--schedule-steps", "9000",
            "--schedule-start", "3000"]  # fmt: skip
    st = cs.Stint(cs.parse_args(argv))
    (tmp_path / "train-1" / "checkpoints" / "step-00000400" / "drafter").mkdir(parents=True)
    (tmp_path / "train-1" / "metrics.jsonl").write_text("".join(json.dumps({"step": k}) + "\n" for k in (200, 400)))
    st.state["train_runs"] = ["train-1"]  # an earlier call of this stint took 400 of its steps
    ran: list[list[str]] = []
    st.run = lambda phase, args, timeout_min: ran.append(args) or 0  # type: ignore[method-assign]
    st.train(6.0)
    cfg = load_config(TrainConfig, _parse(ran[0])["config"], _parse(ran[0])["overrides"])
    cfg.validate()
    assert (cfg.optim.schedule_steps, cfg.optim.schedule_start) == (9000, 3400)
    (tmp_path / "train-2").mkdir()
    (tmp_path / "train-2" / "metrics.jsonl").write_text(json.dumps({"step": 2600}) + "\n")
    assert st.summary()["schedule"] == {"steps": 9000, "start": 3000, "end": 6000}
    (tmp_path / "out").mkdir(exist_ok=True)
    done = cs.Stint(cs.parse_args([*argv[:-1], "8600"]))
    done.state["train_runs"] = ["train-1"]
    done.run = lambda phase, args, timeout_min: ran.append(args) or 0  # type: ignore[method-assign]
    done.train(6.0)  # 8,600 + 400 = the schedule's end: nothing left to train
    assert len(ran) == 1 and done.state["train_runs"] == ["train-1"]
    with pytest.raises(SystemExit):
        cs.parse_args([*argv[:-1], "9000"])


def test_defaults_follow_env_sh_folders(monkeypatch: pytest.MonkeyPatch) -> None:
    a = cs.parse_args(["--stint", "2"])
    assert a.target == "/wk/smollm2-bf16" and a.humaneval == HE
    monkeypatch.delenv("STAGE")
    monkeypatch.delenv("WORK")
    monkeypatch.setenv("GPU_DIR", "/g")
    assert (
        cs.gpu_dir("work") == Path("/g/work")
        and cs.parse_args(["--stint", "2"]).humaneval == "/g/stage/HumanEval.jsonl.gz"
    )


def test_temperature_and_turns_override_the_stint_plan(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--stint",
        "2",
        "--temperature",
        "0",
        "--max-turns",
        "3",
        "--skip",
        "10240",
        "--work",
        "/w",
        "--dry-run",
    ]
    assert cs.main(argv) == 0
    cmd = json.loads(capsys.readouterr().out)
    regen = _parse(cmd["regen"])
    assert (regen["temperature"], regen["max_turns"], regen["seed"]) == (0.0, 3, cs.plan_for(2).seed)
    assert regen["skip"] == 10240
    assert cmd["plan"] == {"temperature": 0.0, "seed": cs.plan_for(2).seed, "max_turns": 3, "skip": 10240}


def test_the_hf_feature_pass_can_be_asked_for(capsys: pytest.CaptureFixture[str]) -> None:
    assert cs.main(["--stint", "4", "--work", "/w", "--feature-pass", "hf", "--dry-run"]) == 0
    train = _parse(json.loads(capsys.readouterr().out)["train"])
    cfg = load_config(TrainConfig, train["config"], train["overrides"])
    cfg.validate()
    assert cfg.runtime.feature_pass == "hf" and cfg.runtime.compile_parts == {"model", "loss"}


def test_every_earlier_stints_data_is_merged(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--stint", "3", "--prev-data", "/p/s1", "--prev-data", "/p/s2", "--work", "/w", "--dry-run"]
    assert cs.main(argv) == 0
    merge = _parse(json.loads(capsys.readouterr().out)["merge"])
    assert merge["inputs"] == ["/p/s1", "/p/s2", "/w/new"] and merge["out"] == "/w/data"


def test_an_earlier_stint_s_pack_is_unpacked_then_merged(tmp_path: Path) -> None:
    """--prev-data X.fdpack (what campaign_ingest.py keeps in git): unpacked once into WORK/prev/, then merged."""
    from flashdraft.data.pack import pack_dataset
    from tests.data.test_pack import _dataset, _rows

    _dataset(tmp_path / "s7")
    pack = tmp_path / "results" / "stint-7" / "new-data.fdpack"
    pack.parent.mkdir(parents=True)
    pack_dataset(tmp_path / "s7", pack)
    work = tmp_path / "w"
    argv = ["--stint", "8", "--prev-data", str(pack), "--prev-data", "/p/s6", "--work", str(work), "--dry-run"]  # fmt: skip
    cmd = cs.commands(cs.parse_args(argv), cs.Budget(0.0, 0.0, 5.0))
    folder = work / "prev" / "stint-7-new-data"
    assert _parse(cmd["merge"])["inputs"] == [str(folder), "/p/s6", str(work / "new")]
    (work / "out").mkdir(parents=True)
    (work / "new").mkdir()
    (work / "new" / "manifest.json").write_text("{}")  # this stint's regeneration
    st = cs.Stint(cs.parse_args([*argv[:-1], "--out", str(work / "out")]))
    ran: list[list[str]] = []
    st.run = lambda phase, args, timeout_min: ran.append(args) or 0  # type: ignore[method-assign]
    st.merge()
    assert ran == [cmd["merge"]] and _rows(folder) == _rows(tmp_path / "s7")


def test_prev_packs_merges_every_staged_pack_in_stint_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """make_stage.py --packs stages each kept pack as campaign-stint-K.fdpack; --prev-packs takes them all."""
    stage = tmp_path / "stage"
    stage.mkdir()
    for k in (10, 8, 9):
        (stage / f"campaign-stint-{k}.fdpack").write_bytes(b"")
    (stage / "sharegpt_compact.json.gz").write_bytes(b"")
    a = cs.parse_args(["--stint", "19", "--prev-data", "/p/s6", "--prev-packs", str(stage), "--work", "/w"])
    assert a.prev_data == ["/p/s6", *(str(stage / f"campaign-stint-{k}.fdpack") for k in (8, 9, 10))]
    assert cs.main(["--stint", "19", "--prev-packs", str(tmp_path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"campaign_stint: --prev-packs {tmp_path}: no campaign-stint-K.fdpack") and err.count("\n") == 1


def test_a_stint_that_trains_on_earlier_stints_data_alone(tmp_path: Path) -> None:
    """--phases merge,train with --prev-data and no regeneration of its own: the merge takes the earlier datasets
    only (a folder `new` it never made would fail the merge); with nothing to merge it stops with a reason."""
    work = tmp_path / "w"
    argv = ["--stint", "11", "--phases", "merge,train", "--prev-data", "/p/s9", "--prev-data", "/p/s10",
            "--work", str(work)]  # fmt: skip
    cmd = cs.commands(cs.parse_args([*argv, "--dry-run"]), cs.Budget(0.0, 0.0, 5.0))
    assert _parse(cmd["merge"])["inputs"] == ["/p/s9", "/p/s10"]
    (work / "out").mkdir(parents=True)
    st = cs.Stint(cs.parse_args([*argv, "--out", str(work / "out")]))
    ran: list[list[str]] = []
    st.run = lambda phase, args, timeout_min: ran.append(args) or 0  # type: ignore[method-assign]
    st.merge()
    assert ran == [cmd["merge"]]
    bare = cs.Stint(cs.parse_args(["--stint", "12", "--phases", "merge,train", "--work", str(tmp_path / "v"),
                                   "--out", str(work / "out")]))  # fmt: skip
    with pytest.raises(cs.StintError, match="nothing to merge"):
        bare.merge()


def test_a_native_feature_pass_that_fails_before_a_checkpoint_trains_again_with_hf(tmp_path: Path) -> None:
    argv = ["--stint", "5", "--work", str(tmp_path), "--out", str(tmp_path / "out"), "--feature-pass", "native",
            "--train-extra", "runtime.compile=model,loss,target", "runtime.feature_pass=native", "optim.lr=1e-4"]  # fmt: skip
    st = cs.Stint(cs.parse_args(argv))
    (tmp_path / "out").mkdir()
    ran: list[list[str]] = []
    st.run = lambda phase, args, timeout_min: ran.append(args) or (1 if len(ran) == 1 else 0)  # type: ignore[method-assign]
    st.train(6.0)
    cfgs = [load_config(TrainConfig, _parse(r)["config"], _parse(r)["overrides"]) for r in ran]
    assert (
        cfgs[1].optim.lr == 1e-4
    )  # the other extras stay; the pass and compile ones go with the native pass
    assert [(c.runtime.feature_pass, c.runtime.compile_parts) for c in cfgs] == [
        ("native", {"model", "loss", "target"}),
        ("hf", {"model", "loss"}),
    ]
    assert st.state["train_runs"] == ["train-1", "train-2"]
    assert "again with hf" in (tmp_path / "out" / "stint.log").read_text()


def test_a_run_that_checkpointed_or_used_hf_is_not_repeated(tmp_path: Path) -> None:
    for feature_pass, checkpointed in (("hf", False), ("native", True)):
        work = tmp_path / feature_pass
        (work / "out").mkdir(parents=True)
        st = cs.Stint(cs.parse_args(["--stint", "5", "--work", str(work), "--out", str(work / "out"),
                                     "--feature-pass", feature_pass]))  # fmt: skip
        if checkpointed:
            (work / "train-1" / "checkpoints" / "step-00000200").mkdir(parents=True)
        ran: list[list[str]] = []
        st.run = lambda phase, args, timeout_min, ran=ran: ran.append(args) or 1  # type: ignore[method-assign]
        st.train(6.0)
        assert len(ran) == 1


def test_regeneration_out_of_gpu_memory_goes_on_with_half_the_batch_tokens(tmp_path: Path) -> None:
    st = cs.Stint(cs.parse_args(["--stint", "5", "--work", str(tmp_path), "--out", str(tmp_path / "out")]))
    (tmp_path / "out").mkdir()
    ran: list[list[str]] = []

    def run(phase: str, args: list[str], timeout_min: float) -> int:
        ran.append(args)
        if len(ran) == 1:
            st.log.write_text("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 39.38 GiB\n")
            return 1
        _manifest(tmp_path / "new", 10, 1000)
        return 0

    st.run = run  # type: ignore[method-assign]
    st.regen(4.0)
    assert [_parse(r)["max_batch_tokens"] for r in ran] == [2_500_000, 1_250_000]
    assert _parse(ran[1])["time_limit"] <= 4.0 and "regen" in st.state["done"]


def test_self_prompts_run_before_the_regeneration_which_answers_them_in_the_minutes_left(tmp_path: Path) -> None:
    argv = ["--stint", "18", "--self-prompts", "500", "--work", str(tmp_path), "--out", str(tmp_path / "out")]
    st = cs.Stint(cs.parse_args(argv))
    (tmp_path / "out").mkdir()
    ran: list[tuple[str, list[str]]] = []

    def run(phase: str, args: list[str], timeout_min: float) -> int:
        ran.append((phase, args))
        if phase == "regen":
            _manifest(tmp_path / "new", 10, 1000)
        return 0

    st.run = run  # type: ignore[method-assign]
    st.regen(3.0)
    assert [p for p, _ in ran] == ["self-prompts", "regen"]
    regen = _parse(ran[1][1])
    assert regen["input"] == [f"prompts:{tmp_path / cs.SELF_PROMPTS}"] and regen["time_limit"] <= 3.0
    assert st.state["done"] == ["self-prompts", "regen"]
    st.regen(3.0)  # done: nothing runs again
    assert len(ran) == 2


@pytest.mark.parametrize(
    ("earlier", "this_run", "retried"),
    [
        ("", "RuntimeError: CUDA error: out of memory\n", True),  # cuBLAS / graph replay wording
        ("torch.OutOfMemoryError: an earlier call\n", "ValueError: bad input\n", False),  # not this run's
    ],
)
def test_only_this_regeneration_s_out_of_memory_is_retried(
    tmp_path: Path, earlier: str, this_run: str, retried: bool
) -> None:
    st = cs.Stint(cs.parse_args(["--stint", "5", "--work", str(tmp_path), "--out", str(tmp_path / "out")]))
    (tmp_path / "out").mkdir()
    st.log.write_text(earlier)
    ran: list[list[str]] = []

    def run(phase: str, args: list[str], timeout_min: float) -> int:
        ran.append(args)
        if len(ran) == 1:
            with st.log.open("a") as f:
                f.write(this_run)
            return 1
        _manifest(tmp_path / "new", 10, 1000)
        return 0

    st.run = run  # type: ignore[method-assign]
    if retried:
        st.regen(4.0)
    else:
        with pytest.raises(cs.StintError, match="regeneration failed"):
            st.regen(4.0)
    assert len(ran) == (2 if retried else 1)


def test_a_failed_phase_s_minutes_are_saved_and_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    he = tmp_path / "HumanEval.jsonl.gz"
    he.write_bytes(b"")
    work, out = tmp_path / "w", tmp_path / "out"

    def run(self, phase: str, args: list[str], timeout_min: float) -> int:  # noqa: ANN001
        self.state["minutes"][phase] = 3.05
        return 1

    monkeypatch.setattr(cs.Stint, "run", run)
    argv = [
        "--stint",
        "5",
        "--work",
        str(work),
        "--out",
        str(out),
        "--humaneval",
        str(he),
        "--phases",
        "regen",
    ]
    assert cs.main(argv) == 2
    assert json.loads((work / "state.json").read_text())["minutes"]["regen"] == 3.05
    assert json.loads((out / "stint.json").read_text())["gpu_minutes"] == 3.05


def test_continue_from_reaches_the_regeneration(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--stint", "6", "--max-turns", "8", "--skip", "10240", "--continue-from", "/p/s3", "--continue-from", "/p/s4",
            "--phases", "regen", "--work", "/w", "--dry-run"]  # fmt: skip
    assert cs.main(argv) == 0
    regen = _parse(json.loads(capsys.readouterr().out)["regen"])
    assert regen["continue_from"] == ["/p/s3", "/p/s4"] and (regen["max_turns"], regen["skip"]) == (8, 10240)


def test_continue_from_a_pack_answers_from_its_unpacked_folder(tmp_path: Path) -> None:
    """A stint's kept data is a pack in git: the regeneration continues from the folder it unpacks to under
    WORK/prev/, unpacked before the regeneration runs."""
    from flashdraft.data.pack import pack_dataset
    from tests.data.test_pack import _dataset, _rows

    _dataset(tmp_path / "s12")
    pack = tmp_path / "results" / "stint-12" / "new-data.fdpack"
    pack.parent.mkdir(parents=True)
    pack_dataset(tmp_path / "s12", pack)
    work = tmp_path / "w"
    argv = ["--stint", "14", "--max-turns", "8", "--skip", "10240", "--phases", "regen", "--work", str(work),
            "--continue-from", str(pack)]  # fmt: skip
    cmd = cs.commands(cs.parse_args([*argv, "--dry-run"]), cs.Budget(3.0, 0.0, 0.0))
    folder = work / "prev" / "stint-12-new-data"
    assert _parse(cmd["regen"])["continue_from"] == [str(folder)]
    (work / "out").mkdir(parents=True)
    st = cs.Stint(cs.parse_args([*argv, "--out", str(work / "out")]))
    ran: list[list[str]] = []

    def run(phase: str, args: list[str], timeout_min: float) -> int:
        assert _rows(folder) == _rows(tmp_path / "s12")  # unpacked before the regeneration starts
        ran.append(args)
        (work / "new").mkdir()
        (work / "new" / "manifest.json").write_text("{}")
        return 0

    st.run = run  # type: ignore[method-assign]
    st.regen(3.0)
    assert _parse(ran[0])["continue_from"] == [str(folder)]

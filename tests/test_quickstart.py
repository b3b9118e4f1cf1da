"""The quickstart's training overrides form a valid train config for every size preset (the
quickstart itself takes minutes and is measured by hand, see benchmarks/RESULTS.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashdraft.config import load_config
from flashdraft.quickstart import CONFIG, SIZES, features_args, regenerate_args, train_overrides
from flashdraft.train.config import TrainConfig


@pytest.mark.parametrize("preset", sorted(SIZES))
def test_train_overrides_make_a_valid_config(preset: str, tmp_path: Path) -> None:
    sizes = SIZES[preset]
    device = "cuda" if preset == "cuda" else "cpu"
    over = train_overrides(sizes, tmp_path / "run", tmp_path / "data", tmp_path / "feats", device)
    cfg = load_config(TrainConfig, CONFIG, over)
    cfg.validate()
    assert cfg.model.block_size == sizes.block_size and cfg.model.num_layers == sizes.layers
    assert cfg.optim.max_steps == sizes.steps and cfg.optim.lr == sizes.lr
    assert cfg.data.max_anchors == sizes.max_anchors and cfg.data.token_budget == sizes.token_budget
    assert cfg.loss.gamma == sizes.gamma and cfg.model.init_from_target == sizes.init_from_target
    assert cfg.runtime.time_limit_min == sizes.train_minutes
    assert cfg.runtime.fit_steps_to_time_limit == (sizes.train_minutes is not None)  # `steps`: an upper bound
    assert cfg.loss.softmax_vocab == sizes.softmax_vocab
    assert cfg.model.target_layer_ids == sizes.target_layer_ids
    assert cfg.pipeline.mode == "offline" and cfg.pipeline.features_dir == str(tmp_path / "feats")
    assert cfg.eval.every == 0  # the config's validation computes references: not on a CPU's budget


def test_preset_follows_the_device_and_the_cpu_bf16_support(monkeypatch: pytest.MonkeyPatch) -> None:
    import flashdraft.quickstart as qs

    assert qs.preset_for("cuda:0") == "cuda"
    monkeypatch.setattr(qs, "cpu_has_native_bf16", lambda: True)
    assert qs.preset_for("cpu") == "cpu" and SIZES["cpu"].dtype == "bfloat16"
    monkeypatch.setattr(qs, "cpu_has_native_bf16", lambda: False)
    assert qs.preset_for("cpu") == "cpu-fp32" and SIZES["cpu-fp32"].dtype == "float32"


def _parse(args: list[str]) -> dict:
    """The parameters the real `flashdraft` CLI parses from `args` (subcommand words first), without running it."""
    import typer

    from flashdraft.cli import app

    cmd = typer.main.get_command(app)
    i = 0
    while hasattr(cmd, "commands"):  # a group: descend by the subcommand words
        cmd, i = cmd.commands[args[i]], i + 1
    params = cmd.make_context(" ".join(args[:i]), list(args[i:])).params
    assert params, args
    return params


@pytest.mark.parametrize("device, bf16", [("cpu", True), ("cpu", False), ("cuda", False)])
def test_quickstart_data_and_features_stages_come_from_the_builders(
    device: str, bf16: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    import flashdraft.quickstart as qs
    from flashdraft.cli import app

    ran: list[list[str]] = []
    monkeypatch.setattr(qs, "_run", lambda args, log: ran.append(list(args)))
    monkeypatch.setattr(qs, "write_first_turns", lambda path, n: None)
    monkeypatch.setattr(qs, "cpu_has_native_bf16", lambda: bf16)
    work = tmp_path / "w"
    r = CliRunner().invoke(app, ["quickstart", "--work", str(work), "--device", device])
    assert r.exit_code == 0, r.output
    sizes = SIZES[qs.preset_for(device)]
    data, feats = work / "data", work / "features"
    regen = regenerate_args(sizes, work / "prompts.jsonl", data, device, sizes.dtype)
    dump = features_args(sizes, data, feats, device, sizes.dtype)
    assert ran[:2] == [regen, dump]
    p = _parse(regen)
    assert p["input"] == [f"prompts:{work / 'prompts.jsonl'}"] and p["out"] == str(data)
    assert (p["batch_size"], p["max_length"], p["block_size"], p["max_new_tokens"]) == (
        sizes.regen_batch, sizes.max_length, sizes.block_size, sizes.max_new_tokens
    )  # fmt: skip
    assert (p["device"], p["dtype"], p["target"], p["eval_fraction"]) == (device, sizes.dtype, "default", 0.1)
    p = _parse(dump)
    assert (p["dataset"], p["out"], p["device"], p["dtype"], p["target_dtype"]) == (
        str(data), str(feats), device, sizes.dtype, sizes.dtype
    )  # fmt: skip
    assert (p["max_length"], p["token_budget"]) == (sizes.max_length, sizes.token_budget)
    if sizes.target_layer_ids:
        assert p["layers"] == ",".join(map(str, sizes.target_layer_ids))
    else:
        assert p["layers"] is None and p["drafter_layers"] == sizes.layers


def test_quickstart_preset_overrides_the_cpu_detection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--preset cpu-fp32 on a bf16 CPU runs the float32 sizes (and says why); an unknown preset is refused."""
    from typer.testing import CliRunner

    import flashdraft.quickstart as qs
    from flashdraft.cli import app

    ran: list[list[str]] = []
    monkeypatch.setattr(qs, "_run", lambda args, log: ran.append(list(args)))
    monkeypatch.setattr(qs, "write_first_turns", lambda path, n: None)
    monkeypatch.setattr(qs, "cpu_has_native_bf16", lambda: True)
    r = CliRunner().invoke(app, ["quickstart", "--work", str(tmp_path / "w"), "--preset", "cpu-fp32"])
    assert r.exit_code == 0, r.output
    assert "sizes 'cpu-fp32' (--preset)" in r.output
    fp32 = SIZES["cpu-fp32"]
    assert ran[0] == regenerate_args(
        fp32, tmp_path / "w" / "prompts.jsonl", tmp_path / "w" / "data", "cpu", "float32"
    )
    r = CliRunner().invoke(app, ["quickstart", "--work", str(tmp_path / "v"), "--preset", "gpu"])
    assert r.exit_code != 0 and "'gpu': use one of cpu, cuda, cpu-fp32" in r.output
    assert not (tmp_path / "v").exists()


def test_training_gets_what_the_run_budget_leaves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU presets keep their 20 minutes on a slower machine: training's time limit is cut to what the data
    and features stages left, less the evals' reserve (never below a minute); the GPU preset has no budget."""
    from typer.testing import CliRunner

    import flashdraft.quickstart as qs
    from flashdraft.cli import app

    cpu = SIZES["cpu"]
    assert (cpu.train_minutes, cpu.total_minutes, qs.EVAL_RESERVE_MIN) == (12.0, 20.0, 3.5)
    assert qs.train_minutes_for(cpu, 4.0) == 12.0  # 12.5 minutes left: the preset's own limit
    assert qs.train_minutes_for(cpu, 12.0) == 4.5
    assert qs.train_minutes_for(cpu, 19.5) == 1.0
    assert qs.train_minutes_for(SIZES["cuda"], 30.0) is None

    now = {"s": 0.0}
    ran: list[list[str]] = []

    def run(args: list[str], log: list[str]) -> None:
        ran.append(list(args))
        if args[0] in ("data", "features"):  # a slow machine: 6 minutes each
            now["s"] += 360.0

    monkeypatch.setattr(qs, "_run", run)
    monkeypatch.setattr(qs.time, "perf_counter", lambda: now["s"])
    monkeypatch.setattr(qs, "write_first_turns", lambda path, n: None)
    monkeypatch.setattr(qs, "cpu_has_native_bf16", lambda: True)
    r = CliRunner().invoke(app, ["quickstart", "--work", str(tmp_path / "w")])
    assert r.exit_code == 0, r.output
    assert "training limited to 4.5 min" in r.output
    train = next(a for a in ran if a[0] == "train")
    assert "runtime.time_limit_min=4.5" in train and f"optim.max_steps={cpu.steps}" in train


def test_qs_screen_runs_the_builders_with_its_gpu_extras(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """benchmarks/gpu/qs_screen.py (no GPU needed to import it) builds its data and features commands with the
    quickstart's builders on the screens' pinned sizes, plus its own target, engine, contamination and --yes."""
    import gzip
    import importlib.util
    import json
    import sys

    import flashdraft.quickstart as qs

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "qs_screen.py"
    spec = importlib.util.spec_from_file_location("qs_screen", path)
    assert spec is not None and spec.loader is not None
    screen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(screen)
    assert screen.regenerate_args is qs.regenerate_args and screen.features_args is qs.features_args

    calls: list[list[str]] = []
    monkeypatch.setattr(screen, "sh", lambda args, log: calls.append(list(args)) or 0)
    (tmp_path / "p").mkdir()
    with gzip.open(tmp_path / "p" / "p3000.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"id": str(i), "prompt": "hi"}) + "\n" for i in range(400)))
    work, target = tmp_path / "qs", "/models/smollm2-fp32"
    monkeypatch.setattr(sys, "argv", ["qs_screen.py", "--prompts", str(tmp_path / "p"), "--work", str(work),
                                      "--out", str(tmp_path / "out"), "--target", target, "--budget-s", "0",
                                      "--contamination", "humaneval:/x.jsonl.gz", "--variants", "base"])  # fmt: skip
    screen.main()  # budget 0: data and features commands, no training, the eval (sh is stubbed)
    fd = [sys.executable, "-m", "flashdraft.cli"]
    assert [c[: len(fd)] for c in calls] == [fd] * 3
    regen, dump = calls[0][len(fd) :], calls[1][len(fd) :]
    base = screen.SCREEN_BASE  # the screens' base recipe: 4 layers, b4, layer 15, float32
    assert (base.layers, base.block_size, base.target_layer_ids, base.dtype) == (4, 4, [15], "float32")
    p = _parse(regen)
    assert p["input"] == [f"prompts:{work / 'p300.jsonl'}"] and p["out"] == str(work / "d300")
    assert (p["target"], p["engine"], p["contamination"], p["batch_size"]) == (
        target, "native", ["humaneval:/x.jsonl.gz"], 512
    )  # fmt: skip
    assert (p["device"], p["dtype"], p["block_size"], p["max_length"], p["max_new_tokens"]) == (
        "cuda", "float32", 4, 384, 96
    )  # fmt: skip
    p = _parse(dump)
    assert (p["target"], p["dataset"], p["out"], p["layers"], p["yes"]) == (
        target, str(work / "d300"), str(work / "f300-l15"), "15", True
    )  # fmt: skip
    assert (p["device"], p["dtype"], p["target_dtype"], p["max_length"], p["token_budget"]) == (
        "cuda", "float32", "float32", 384, 1024
    )  # fmt: skip

    # a variant that reads other target layers gets its own features dump; --eval-size picks the eval set
    calls.clear()
    monkeypatch.setattr(sys, "argv", ["qs_screen.py", "--prompts", str(tmp_path / "p"), "--work", str(work / "b"),
                                      "--out", str(tmp_path / "out"), "--budget-s", "0", "--eval-size", "400",
                                      "--variants", "base,d450-l2b3-1000-f27,d900m48-l2b3-1000"])  # fmt: skip
    screen.main()
    outs = [str(_parse(c[len(fd) :])["out"]) for c in calls]
    expect = [
        work / "b" / x for x in ("d300", "f300-l15", "d400", "d450", "f450-l27", "d900-m48", "f900-m48-l15")
    ]
    assert outs == [str(x) for x in [*expect, tmp_path / "out" / "eval"]]
    assert _parse(calls[4][len(fd) :])["layers"] == "27"
    assert _parse(calls[5][len(fd) :])["max_new_tokens"] == 48  # shorter answers for that variant's data only
    assert _parse(calls[3][len(fd) :])["max_new_tokens"] == 96
    assert _parse(calls[-1][len(fd) :])["dataset"] == str(work / "b" / "d400")


def test_an_unfinished_run_is_set_aside_not_appended_to(tmp_path: Path) -> None:
    """A run folder without checkpoints (a quickstart killed early) is renamed beside itself before training
    starts again, with its files intact; an empty or missing folder is left alone."""
    from flashdraft.quickstart import set_aside_unfinished_run

    run = tmp_path / "run"
    assert set_aside_unfinished_run(run) is None
    run.mkdir()
    assert set_aside_unfinished_run(run) is None and run.is_dir()
    (run / "metrics.jsonl").write_text('{"step": 5}\n')
    aside = set_aside_unfinished_run(run)
    assert aside is not None and not run.exists()
    assert aside.parent == tmp_path and aside.name.startswith("run.unfinished-")
    assert (aside / "metrics.jsonl").read_text() == '{"step": 5}\n'

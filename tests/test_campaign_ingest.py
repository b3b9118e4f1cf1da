"""benchmarks/campaign_ingest.py on a CPU with a real tiny bundle (campaign_stint.py's Stint.ship on a tiny
drafter): parts joined and checked, unpacked once, small files recorded, the stint's line upserted, the yardstick
eval's paired verdicts recorded (the eval itself faked: its command line parsed by the real CLI), the promotion
gate, the export over a models folder in tmp_path and its model card's regenerated section."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

from flashdraft.data.pack import unpack_dataset
from flashdraft.drafter import DFlashDrafter
from flashdraft.eval.frozen import FROZEN_FORMAT
from flashdraft.files import file_sha256
from flashdraft.serve.export import export_drafter
from tests.conftest import tiny_drafter, tiny_target
from tests.data.test_pack import _dataset, _rows
from tests.serve.test_export import tiny_tokenizer
from tests.test_campaign_script import _manifest, cs
from tests.test_quickstart import _parse

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("campaign_ingest", REPO / "benchmarks" / "campaign_ingest.py")
ci = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["campaign_ingest"] = ci
_spec.loader.exec_module(ci)  # type: ignore[union-attr]

CARD = """# tiny drafter

Hand-written introduction.

## Campaign

an outdated table

## Measured

Hand-written figures.
"""


def _call(root: Path, stint: int, seed: int, new: bool = True) -> Path:
    """What one device call of campaign_stint.py brings back, made by its Stint.ship on a tiny drafter; `new`:
    with the stint's new data (a training call after the regeneration's call has none)."""
    work, out = root / "work", root / "out"
    st = cs.Stint(cs.parse_args(["--stint", str(stint), "--work", str(work), "--out", str(out)]))
    out.mkdir(parents=True)
    if new:
        _dataset(work / "new")  # a real one: it is packed into the results
    _manifest(work / "data", 350, 150_000)
    ck = work / "train-1" / "checkpoints" / "step-00000020"
    tiny_drafter(tiny_target("llama", dtype=torch.float32), block_size=8, seed=seed).save_pretrained(
        ck / "drafter"
    )
    lines = [
        {"step": 20, "step_time_s": 0.3, "loss": 1.0},
        {"step": 20, "val/chain_tau": 2.5, "val/ddtree_tau": 4.0},
    ]
    (work / "train-1" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (work / "train-1" / "config.yaml").write_text("model:\n  target: /wk/smollm2-bf16\n")
    rep = work / "eval" / "humaneval"
    rep.mkdir(parents=True)
    methods = {"chain": {"tau": 3.1}, "ddtree-8": {"tau": 4.0}, "topk-8": {"tau": 5.0}}
    (rep / "report.json").write_text(json.dumps({"drafters": {"d": {"samples": 48, "methods": methods}}}))
    (rep / "report.md").write_text("| d | 3.1 |\n")
    (rep / "report_tau.png").write_bytes(b"\x89PNG")  # plots stay out of the results folder
    st.state.update(train_runs=["train-1"], minutes={"regen": 3.0, "train": 5.0}, calls=1)
    st.ship()
    return out


@pytest.fixture(scope="module")
def calls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("calls")
    return {
        "a": _call(root / "a", 2, seed=1),
        "b": _call(root / "b", 2, seed=2),
        "train-only": _call(root / "c", 2, seed=3, new=False),
    }


@pytest.fixture
def call(calls: dict[str, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(calls["a"], tmp_path / "call"))


def _argv(tmp: Path, folder: Path, *more: str) -> list[str]:
    return [str(folder), "--data", str(tmp / "data"), "--results", str(tmp / "results"),
            "--models", str(tmp / "models"), *more]  # fmt: skip


def _no_eval(args: list[str], log: Path) -> int:
    raise AssertionError(f"no eval expected: {args}")


def test_join_unpack_record_and_curve_twice_give_the_same(
    call: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert ci.main(_argv(tmp_path, call), run_eval=_no_eval) == 0
    first = capsys.readouterr().out
    unpacked = tmp_path / "data" / "stint-2"
    assert "[unpack]" in first and "checked, unpacked into" in first
    assert (unpacked / "drafter" / "config.json").is_file() and (
        unpacked / "new-data" / "manifest.json"
    ).is_file()
    assert not list((tmp_path / "data").glob(".*"))  # no staging folder or joined tar left behind
    d = DFlashDrafter.from_pretrained(unpacked / "drafter")
    assert next(d.parameters()).dtype == torch.bfloat16
    res = tmp_path / "results" / "stint-2"
    files = sorted(p.relative_to(res).as_posix() for p in res.rglob("*") if p.is_file())
    assert files == ["config.yaml", "eval/humaneval/report.json", "eval/humaneval/report.md", "metrics.jsonl",
                     "new-data.fdpack", "stint.json"]  # fmt: skip
    # the new data outlives this workstation as one file in the results, which unpacks to the same dataset
    assert "[pack]" in first
    unpack_dataset(res / "new-data.fdpack", tmp_path / "again")
    assert _rows(tmp_path / "again") == _rows(unpacked / "new-data")
    assert (res / "stint.json").read_bytes() == (call / "stint.json").read_bytes()
    stints = tmp_path / "results" / "stints.jsonl"
    rows = [json.loads(x) for x in stints.read_text().splitlines()]
    line = json.loads((call / "stint.json").read_text())
    # the line is the stint's, plus how much of its new answers loops (`flashdraft data inspect`)
    from flashdraft.data.dataset import open_dataset
    from flashdraft.data.inspect import repetition_stats

    rep = repetition_stats(open_dataset(str(unpacked / "new-data"), "train"))
    assert rep.summary()["answer_tokens"] == line["new"]["loss_tokens"]
    assert len(rows) == 1 and rows[0] == {**line, "new": {**line["new"], "repetition": rep.summary()}}
    assert "[promote] not promoted: stint 2 has no sharegpt-heldout yardstick result" in first
    png = tmp_path / "results" / "learning_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    before = stints.read_bytes()
    assert ci.main(_argv(tmp_path, call), run_eval=_no_eval) == 0
    again = capsys.readouterr().out
    assert "already holds this bundle" in again and "unchanged (6 files)" in again
    assert "stint 2 unchanged (1 stints)" in again and stints.read_bytes() == before


def test_the_same_stint_replaces_its_line_and_keeps_the_others(tmp_path: Path) -> None:
    stints = tmp_path / "stints.jsonl"
    stints.write_text(json.dumps({"stint": 3, "x": 1}) + "\n" + json.dumps({"stint": 1, "x": 1}) + "\n")
    ci.upsert(stints, {"stint": 2, "x": 1})
    ci.upsert(stints, {"stint": 2, "x": 2})
    ci.upsert(stints, {"stint": 1, "x": 3})
    assert [json.loads(x) for x in stints.read_text().splitlines()] == [
        {"stint": 1, "x": 3}, {"stint": 2, "x": 2}, {"stint": 3, "x": 1}]  # fmt: skip


def _cut(folder: Path, n: int) -> None:
    """The bundle cut into n parts (parts.sh cuts at 15 MiB; a tiny bundle is one part)."""
    parts = sorted(folder.glob("bundle.tar.part*"))
    data = b"".join(p.read_bytes() for p in parts)
    for p in parts:
        p.unlink()
    step = -(-len(data) // n)
    for k in range(n):
        (folder / f"bundle.tar.part{k:02d}").write_bytes(data[k * step : (k + 1) * step])


def _error(tmp: Path, folder: Path, capsys: pytest.CaptureFixture[str], *more: str) -> str:
    assert ci.main(_argv(tmp, folder, *more), run_eval=_no_eval) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("campaign_ingest: "), err
    return err


def test_missing_or_damaged_inputs_are_one_line_errors(
    call: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _cut(call, 3)
    (call / "bundle.tar.part01").rename(tmp_path / "p1")
    assert f"{call / 'bundle.tar.part01'}: missing (next is bundle.tar.part02)" in _error(
        tmp_path, call, capsys
    )
    (tmp_path / "p1").rename(call / "bundle.tar.part01")
    good = (call / "bundle.tar.part02").read_bytes()
    (call / "bundle.tar.part02").write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    assert "a part is damaged or missing" in _error(tmp_path, call, capsys)
    (call / "bundle.tar.part02").write_bytes(good)
    (call / "SHA256").rename(tmp_path / "sums")
    assert f"{call / 'SHA256'}: missing" in _error(tmp_path, call, capsys)
    (tmp_path / "sums").rename(call / "SHA256")
    (call / "stint.json").rename(tmp_path / "stint.json")
    assert f"{call / 'stint.json'}: missing" in _error(tmp_path, call, capsys)
    assert (
        list((tmp_path / "data").iterdir()) == [] and not (tmp_path / "results").exists()
    )  # nothing half-made
    (tmp_path / "stint.json").rename(call / "stint.json")
    assert ci.main(_argv(tmp_path, call), run_eval=_no_eval) == 0  # three parts join into the same bundle


def test_another_bundle_of_the_stint_needs_overwrite(
    calls: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert ci.main(_argv(tmp_path, calls["a"]), run_eval=_no_eval) == 0
    weights = tmp_path / "data" / "stint-2" / "drafter" / "model.safetensors"
    before = weights.read_bytes()
    capsys.readouterr()
    assert "holds another bundle of stint 2: pass --overwrite" in _error(tmp_path, calls["b"], capsys)
    assert weights.read_bytes() == before
    assert ci.main(_argv(tmp_path, calls["b"], "--overwrite"), run_eval=_no_eval) == 0
    assert (
        weights.read_bytes()
        == (calls["b"].parent / "work" / "drafter-bf16" / "model.safetensors").read_bytes()
    )
    assert len((tmp_path / "results" / "stints.jsonl").read_text().splitlines()) == 1


def test_a_later_call_without_new_data_keeps_the_stints_new_data(
    calls: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stint's regeneration and training come home as two bundles; the training's has no new data, and replacing
    the first with it keeps the first's data, its pack in the results and its repetition shares in the line."""
    assert ci.main(_argv(tmp_path, calls["a"]), run_eval=_no_eval) == 0
    res, unpacked = tmp_path / "results" / "stint-2", tmp_path / "data" / "stint-2"
    pack, rows = (res / "new-data.fdpack").read_bytes(), _rows(unpacked / "new-data")
    capsys.readouterr()
    assert ci.main(_argv(tmp_path, calls["train-only"], "--overwrite"), run_eval=_no_eval) == 0
    assert "kept the new data of the bundle it replaces" in capsys.readouterr().out
    assert (res / "new-data.fdpack").read_bytes() == pack and _rows(unpacked / "new-data") == rows
    weights = calls["train-only"].parent / "work" / "drafter-bf16" / "model.safetensors"
    assert (unpacked / "drafter" / "model.safetensors").read_bytes() == weights.read_bytes()
    (line,) = map(json.loads, (tmp_path / "results" / "stints.jsonl").read_text().splitlines())
    assert "repetition" in line["new"]


def _yardstick(tmp: Path, name: str = "sharegpt-heldout-100") -> Path:
    head = {"format": FROZEN_FORMAT, "target": "t", "target_fingerprint": "f", "dtype": "float32",
            "max_new_tokens": 64, "stop_token_ids": [2]}  # fmt: skip
    f = tmp / f"{name}.jsonl"
    f.write_text(
        json.dumps({**head, "id": "a", "prompt_ids": [1, 3], "tokens": [4, 2], "stop_reason": "stop"}) + "\n"
    )
    return f


def _fake_eval(verdict: str, ran: list[list[str]]):  # type: ignore[no-untyped-def]
    """An eval that writes the report flashdraft eval would, with the given paired chain verdict."""

    def run(args: list[str], log: Path) -> int:
        p = _parse(args)  # the real CLI's parameters
        assert (
            p["device"] == "cpu"
            and p["dtype"] == "float32"
            and p["max_new_tokens"] == 64
            and not p["progress"]
        )
        ran.append(args)
        shipped, new = (Path(x).name for x in p["drafter"])
        methods = lambda c: {"chain": {"tau": c}, "ddtree-8": {"tau": c + 1}, "topk-8": {"tau": c + 2}}  # noqa: E731
        chain = {"delta": 0.41234567, "se": 0.1, "n": 40, "verdict": verdict}
        report = {"drafters": {
            shipped: {"samples": 40, "methods": methods(3.0), "paired": None},
            new: {"samples": 40, "methods": methods(3.4), "paired": {"baseline": shipped, "methods": {"chain": chain}}},
        }}  # fmt: skip
        p["out"].mkdir(parents=True)
        (p["out"] / "report.json").write_text(json.dumps(report))
        (p["out"] / "report.md").write_text("table\n")
        log.write_text("ok\n")
        return 0

    return run


def _models(tmp: Path) -> Path:
    """A shipped drafter folder with a hand-written model card (never the repository's models/)."""
    tok = tiny_tokenizer(tmp / "tok")
    d = tiny_drafter(tiny_target("llama", dtype=torch.float32), block_size=8, seed=7)
    d.save_pretrained(tmp / "old")
    export_drafter(tmp / "old", tmp / "models", target=str(tok))
    (tmp / "models" / "README.md").write_text(CARD)
    return tok


def test_yardstick_verdicts_go_into_the_line_and_run_once(
    call: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _models(tmp_path)
    ys, ran = _yardstick(tmp_path), []
    argv = _argv(tmp_path, call, "--yardstick", str(ys), "--limit", "40", "--threads", "2")
    assert ci.main(argv, run_eval=_fake_eval("neither", ran)) == 0
    out = capsys.readouterr().out
    p = _parse(ran[0])
    unpacked = tmp_path / "data" / "stint-2"
    assert p["drafter"] == [tmp_path / "models", unpacked / "drafter"]  # the shipped one first: the baseline
    assert p["references"] == ys and p["limit"] == 40 and p["threads"] == 2 and p["target"] == "default"
    line = json.loads((tmp_path / "results" / "stints.jsonl").read_text())
    y = line["yardstick"]["sharegpt-heldout-100"]
    assert y["new"] == {"chain_tau": 3.4, "ddtree_tau": 4.4, "ddtree_budget": "ddtree-8", "topk8_streak": 5.4}
    assert y["shipped"]["chain_tau"] == 3.0 and y["baseline"] == "models" and y["prompts"] == 40
    assert y["paired"]["chain"] == {"delta": 0.4123, "se": 0.1, "n": 40, "verdict": "neither"}
    assert (
        "[promote] not promoted: sharegpt-heldout-100: chain Δτ +0.412 ± 0.100 SE over 40 prompts, neither: better on"
        in out
    )
    assert (tmp_path / "results" / "stint-2" / "yardstick" / "sharegpt-heldout-100" / "report.json").is_file()

    assert ci.main(argv, run_eval=_fake_eval("neither", ran)) == 0
    assert len(ran) == 1 and "already evaluated" in capsys.readouterr().out
    assert (
        ci.main([*argv, "--limit", "20"], run_eval=_fake_eval_again(ran)) == 0
    )  # other options: evaluated again
    assert len(ran) == 2


def _fake_eval_again(ran: list[list[str]]):  # type: ignore[no-untyped-def]
    inner = _fake_eval("neither", ran)

    def run(args: list[str], log: Path) -> int:
        shutil.rmtree(_parse(args)["out"])  # flashdraft eval writes over its --out folder
        return inner(args, log)

    return run


@pytest.mark.parametrize(
    "line, ok, why",
    [
        ({"stint": 4}, False, "stint 4 has no sharegpt-heldout yardstick result"),
        ({"stint": 4, "yardstick": {"humaneval-164": {"paired": {"chain": {"verdict": "better"}}}}}, False,
         "no sharegpt-heldout yardstick"),
        ({"stint": 4, "yardstick": {"sharegpt-heldout-100": {"paired": {"chain": {"delta": 0.3, "se": 0.1, "n": 9,
         "verdict": "better"}}}}}, True, "chain Δτ +0.300 ± 0.100 SE over 9 prompts, better"),
        ({"stint": 4, "yardstick": {"sharegpt-heldout-100": {"paired": {"chain": {"delta": 0.0, "se": 0.1, "n": 9,
         "verdict": "neither"}}}, "humaneval-164": {"paired": {"chain": {"delta": 0.2, "se": 0.02, "n": 164,
         "verdict": "better"}}}}}, True, "better than the shipped drafter, worse on none"),
        ({"stint": 4, "yardstick": {"sharegpt-heldout-100": {"paired": {"chain": {"delta": -0.3, "se": 0.1, "n": 9,
         "verdict": "worse"}}}, "humaneval-164": {"paired": {"chain": {"delta": 0.2, "se": 0.02, "n": 164,
         "verdict": "better"}}}}}, False, "sharegpt-heldout-100: chain Δτ -0.300 ± 0.100 SE over 9 prompts, worse"),
        ({"stint": 4, "yardstick": {"sharegpt-heldout-100": {"paired": {"chain": {"delta": -0.3, "se": 0.1, "n": 9,
         "verdict": "worse"}}}}}, False, "two SE worse"),
        ({"stint": 4, "yardstick": {"sharegpt-heldout-100": {"paired": {"chain": {"delta": 0.1, "se": 0.1, "n": 9,
         "verdict": "neither"}, "ddtree-512": {"delta": 1.0, "se": 0.1, "n": 9, "verdict": "better"}}}}}, False,
         "better on none"),  # only the chain τ decides
        ({"stint": 4, "yardstick": {"sharegpt-heldout-100": {"paired": {"chain": {"delta": 0.9, "se": None, "n": 1,
         "verdict": None}}}}}, False, "over two or more prompts (n=1)"),
    ],
)  # fmt: skip
def test_promotion_needs_a_better_held_out_chain_tau_and_no_worse_one(line: dict, ok: bool, why: str) -> None:
    got, reason = ci.promote_decision(line)
    assert got == ok and why in reason, reason


def test_promote_exports_keeps_the_card_and_regenerates_its_section(
    call: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tok = _models(tmp_path)
    models, ys, ran = tmp_path / "models", _yardstick(tmp_path), []
    shipped = (models / "model.safetensors").read_bytes()
    argv = _argv(tmp_path, call, "--yardstick", str(ys), "--target", str(tok))
    assert ci.main(argv, run_eval=_fake_eval("better", ran)) == 0  # without --promote: says what it would do
    assert (
        "would export" in capsys.readouterr().out and (models / "model.safetensors").read_bytes() == shipped
    )
    assert (models / "README.md").read_text() == CARD

    assert ci.main([*argv, "--promote"], run_eval=_fake_eval("better", ran)) == 0
    out = capsys.readouterr().out
    assert "[promote] exported" in out and "[card]" in out and len(ran) == 1
    new = DFlashDrafter.from_pretrained(models)
    bundle = DFlashDrafter.from_pretrained(tmp_path / "data" / "stint-2" / "drafter")
    assert all(
        torch.equal(a, b)
        for a, b in zip(new.state_dict().values(), bundle.state_dict().values(), strict=True)
    )
    assert (models / "modeling_dflash.py").is_file()
    card = (models / "README.md").read_text()
    assert card.startswith("# tiny drafter\n\nHand-written introduction.\n\n## Campaign\n")
    assert card.endswith("\n## Measured\n\nHand-written figures.\n") and "an outdated table" not in card
    row = next(x for x in card.splitlines() if x.startswith("| 2 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    line = json.loads((tmp_path / "results" / "stints.jsonl").read_text())
    n, loss = line["new"]["samples"], line["new"]["loss_tokens"]  # the bundle's new data
    loops = line["new"]["repetition"]
    share = f"{loops['repeated']:.0%} / {loops['at_cap']:.0%}"
    new_cells = [f"{n:,}", f"{loss / 1e6:.2f}M", share, f"{n:,} / {loss / 1e6:.2f}M"]
    assert line["promoted"] == cells[-1] and cells[5:12] == ["20", *new_cells, "350 / 0.15M", "2.50"]
    assert cells[12] == "3.40 / 4.40"  # the yardstick's chain / best DDTree τ

    assert ci.main([*argv, "--promote"], run_eval=_fake_eval("better", ran)) == 0  # again: nothing changes
    out = capsys.readouterr().out
    assert "already this stint's drafter" in out and "kept" in out and len(ran) == 1
    assert (models / "README.md").read_text() == card


def test_campaign_section_is_added_when_the_card_has_none() -> None:
    section = ci.campaign_section([{"stint": 0, "gpu_minutes": 30.0}])
    card = ci.replace_section("# d\n\ntext\n", section)
    assert card == "# d\n\ntext\n\n" + section and ci.replace_section(card, section) == card
    assert "| 0 | — | — | 30.0 | — |" in section


def test_campaign_section_adds_up_what_the_stints_regenerated_in_stint_order() -> None:
    rows = [{"stint": 1, "new": {"samples": 10, "loss_tokens": 2_000_000}, "cumulative": {"samples": 15, "loss_tokens": 3_000_000}},
            {"stint": 0, "new": {"samples": 100, "loss_tokens": 30_000_000}}]  # fmt: skip
    lines = [x for x in ci.campaign_section(rows).splitlines() if x.startswith("| 0 ") or x.startswith("| 1 ")]
    assert "| 100 / 30.00M | — |" in lines[0]  # stint 0 first, whatever the file's order
    assert "| 110 / 32.00M | 15 / 3.00M |" in lines[1]


def test_learning_curve_plots_the_yardstick_tau() -> None:
    plc = ci.plot_learning_curve
    row = {"stint": 1, "train_minutes": 9.0, "cumulative": {"loss_tokens": 5},
           "eval": {"humaneval": {"chain_tau": 3.0, "ddtree_tau": 5.0}},
           "yardstick": {"sharegpt-heldout-100": {"new": {"chain_tau": 4.1, "ddtree_tau": 6.2}}}}  # fmt: skip
    (p,) = plc.curve([row])
    assert p.tau == {"humaneval": (3.0, 5.0), "sharegpt-heldout-100": (4.1, 6.2)}


def test_learning_curve_adds_up_minutes_and_regenerated_tokens_in_stint_order() -> None:
    plc = ci.plot_learning_curve
    rows = [{"stint": 1, "train_minutes": 7.5, "new": {"loss_tokens": 7}, "cumulative": {"loss_tokens": 7}},
            {"stint": 0, "train_minutes": 36.0, "new": {"loss_tokens": 35}}]  # fmt: skip
    points = plc.curve(rows)
    assert [(p.stint, p.train_minutes, p.loss_tokens) for p in points] == [(0, 36.0, 35), (1, 43.5, 42)]


def test_sha256_of_the_weights_names_the_shipped_drafter(tmp_path: Path) -> None:
    f = tmp_path / "w"
    f.write_bytes(b"x" * 3_000_000)  # more than one 1 MiB block
    assert file_sha256(f) == hashlib.sha256(f.read_bytes()).hexdigest()


def test_a_file_the_stint_did_not_write_is_not_replaced(
    call: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert ci.main(_argv(tmp_path, call), run_eval=_no_eval) == 0
    res = tmp_path / "results" / "stint-2"
    (res / "notes.md").write_text("mine")
    (res / "eval" / "humaneval" / "report.md").write_text("edited")
    (tmp_path / "data" / "stint-2" / "metrics.jsonl").write_text("{}\n")  # the bundle's file changed
    err = _error(tmp_path, call, capsys)
    assert "not what this stint's bundle holds: pass --overwrite" in err
    assert (res / "notes.md").read_text() == "mine"
    assert ci.main(_argv(tmp_path, call, "--overwrite"), run_eval=_no_eval) == 0
    assert not (res / "notes.md").exists() and (res / "metrics.jsonl").read_text() == "{}\n"


def test_a_failed_yardstick_eval_is_one_line_and_records_nothing(
    call: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _models(tmp_path)
    argv = _argv(tmp_path, call, "--yardstick", str(_yardstick(tmp_path)))
    assert ci.main(argv, run_eval=lambda args, log: 1) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "flashdraft eval on" in err and "failed (exit 1): see" in err
    assert not (tmp_path / "results").exists()
    assert "no frozen reference file" in _error(
        tmp_path, call, capsys, "--yardstick", str(tmp_path / "none.jsonl")
    )


def test_a_verdict_against_a_drafter_no_longer_shipped_does_not_promote(
    call: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tok = _models(tmp_path)
    ys, ran = _yardstick(tmp_path), []
    argv = _argv(tmp_path, call, "--target", str(tok))
    assert ci.main([*argv, "--yardstick", str(ys)], run_eval=_fake_eval("better", ran)) == 0
    assert "would export" in capsys.readouterr().out
    other = tiny_drafter(tiny_target("llama", dtype=torch.float32), block_size=8, seed=9)
    other.save_pretrained(tmp_path / "other")
    export_drafter(
        tmp_path / "other", tmp_path / "models", target=str(tok), overwrite=True
    )  # shipped meanwhile
    shipped = (tmp_path / "models" / "model.safetensors").read_bytes()
    assert ci.main([*argv, "--promote"], run_eval=_no_eval) == 0
    out = capsys.readouterr().out
    assert "not promoted" in out and "compared with another shipped drafter: pass --yardstick again" in out
    assert (tmp_path / "models" / "model.safetensors").read_bytes() == shipped


def test_the_real_yardstick_eval_pairs_the_stint_with_the_shipped_drafter(call: Path, tmp_path: Path) -> None:
    """`flashdraft eval --references` run by the script (a subprocess, this checkout's package) on a saved tiny
    target: the shipped drafter is the report's baseline and the stint's line gets its real paired verdicts."""
    from flashdraft.eval.prompts import EvalPrompt
    from flashdraft.eval.references import ReferenceSettings, compute_references, write_frozen

    _models(tmp_path)
    target = tiny_target("llama", dtype=torch.float32)  # the one the bundle's and the shipped drafter fit
    target.model.save_pretrained(tmp_path / "target")
    prompts = [EvalPrompt(f"c{i}", [3 + i, 8, 13, 21], "token ids") for i in range(3)]
    s = ReferenceSettings(max_new_tokens=12, stop_token_ids=[])
    refs = compute_references(target, prompts, s, cache_dir=tmp_path / "cache", progress=False).references
    ys = write_frozen(tmp_path / "sharegpt-heldout-3.jsonl", refs, target, s)
    argv = _argv(
        tmp_path, call, "--yardstick", str(ys), "--target", str(tmp_path / "target"), "--threads", "1"
    )
    assert ci.main(argv) == 0
    y = json.loads((tmp_path / "results" / "stints.jsonl").read_text())["yardstick"]["sharegpt-heldout-3"]
    assert (y["baseline"], y["drafter"], y["prompts"]) == ("models", "stint-2/drafter", 3)
    assert y["paired"]["chain"]["n"] == 3 and y["paired"]["chain"]["verdict"] in (
        "better",
        "worse",
        "neither",
    )
    report = json.loads(
        (tmp_path / "data" / "stint-2" / "yardstick" / "sharegpt-heldout-3" / "report.json").read_text()
    )
    assert y["new"]["chain_tau"] == report["drafters"]["stint-2/drafter"]["methods"]["chain"]["tau"]
    assert report["dtype"] == "float32" and report["device"] == "cpu"


def test_start_row_sums_the_manifests_and_takes_the_shipped_side(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location(
        "campaign_start_row", REPO / "benchmarks/campaign_start_row.py"
    )
    sr = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(sr)  # type: ignore[union-attr]
    mans = []
    for k, (n, t) in enumerate([(10, 1000), (5, 300)]):
        mans.append(tmp_path / f"m{k}.json")
        mans[-1].write_text(json.dumps({"counts": {"train": n}, "tokens": {"train": {"loss": t}}}))
    stints = tmp_path / "stints.jsonl"
    line = {"stint": 1, "yardstick": {"he": {"new": {"chain_tau": 3.1}, "shipped": {"chain_tau": 3.0}}}}
    stints.write_text(json.dumps({"stint": 0, "old": True}) + "\n" + json.dumps(line) + "\n")
    argv = ["--stints", str(stints), "--train-minutes", "5", "6.5", "--card", "H200", "--date", "2026-12-03"]
    sr.main(argv + [a for m in mans for a in ("--manifest", str(m))])
    rows = [json.loads(x) for x in stints.read_text().splitlines()]
    assert [r["stint"] for r in rows] == [0, 1] and rows[1] == line
    assert rows[0]["train_minutes"] == 11.5 and rows[0]["new"] == {"samples": 15, "loss_tokens": 1300}
    assert rows[0]["yardstick"]["he"]["new"] == {"chain_tau": 3.0}


def _gpu_report(tmp: Path, verdicts: dict[str, str]) -> Path:
    """A three-drafter report as `flashdraft eval --references` writes it on a GPU: the shipped drafter first,
    then two stints' drafters, each paired with the shipped one."""
    methods = lambda c: {"chain": {"tau": c}, "ddtree-8": {"tau": c + 1}, "topk-8": {"tau": c + 2}}  # noqa: E731
    drafters = {"models": {"samples": 100, "methods": methods(4.0), "paired": None}}
    for k, (name, verdict) in enumerate(verdicts.items()):
        chain = {"delta": -0.5 + k, "se": 0.06, "n": 100, "verdict": verdict}
        drafters[name] = {"samples": 100, "methods": methods(3.5 + k),
                          "paired": {"baseline": "models", "methods": {"chain": chain}}}  # fmt: skip
    f = tmp / "gpu" / "sharegpt-heldout-100" / "report.json"
    f.parent.mkdir(parents=True)
    head = {"dtype": "float32", "temperature": 0.0, "max_new_tokens": 256}
    source = {"source": "frozen:sharegpt-heldout-100.jsonl"}
    f.write_text(json.dumps({**head, "references": source, "drafters": drafters}))
    (f.parent / "report.md").write_text("three drafters\n")
    return f


def test_a_gpu_report_is_adopted_for_the_named_drafter(
    call: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _models(tmp_path)
    rep = _gpu_report(tmp_path, {"stint-1-drafter": "worse", "drafter-bf16": "better"})
    argv = _argv(tmp_path, call, "--report", str(rep), "--report-drafter", "stint-1-drafter")
    assert ci.main(argv, run_eval=_no_eval) == 0
    out = capsys.readouterr().out
    assert "adopted" in out and "unverified, never promoted" in out
    assert "not promoted: sharegpt-heldout-100: an adopted report that names no weights" in out
    y = json.loads((tmp_path / "results" / "stints.jsonl").read_text())["yardstick"]["sharegpt-heldout-100"]
    assert (
        y["drafter"] == "stint-1-drafter"
        and y["new"]["chain_tau"] == 3.5
        and y["shipped"]["chain_tau"] == 4.0
    )
    assert y["paired"]["chain"]["verdict"] == "worse" and y["baseline"] == "models"
    kept = tmp_path / "results" / "stint-2" / "yardstick" / "sharegpt-heldout-100"
    assert (kept / "report.md").read_text() == "three drafters\n" and (kept / "report.json").is_file()

    assert ci.main(argv, run_eval=_no_eval) == 0
    assert "already adopted" in capsys.readouterr().out
    # the other drafter of the same report: its own verdict replaces the first
    assert ci.main([*argv[:-1], "drafter-bf16"], run_eval=_no_eval) == 0
    y = json.loads((tmp_path / "results" / "stints.jsonl").read_text())["yardstick"]["sharegpt-heldout-100"]
    assert y["drafter"] == "drafter-bf16" and y["paired"]["chain"]["verdict"] == "better"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda r: r["drafters"].pop("models"),
            "its first drafter is 'stint-1-drafter', not the shipped 'models'",
        ),
        (lambda r: r.update(references={"source": "humaneval"}), "not an eval report on a frozen yardstick"),
        (lambda r: r["drafters"].pop("stint-1-drafter"), "--report-drafter 'stint-1-drafter' is not one of"),
        (lambda r: r.update(dtype="bfloat16"), "the yardstick is scored with {'dtype': 'float32'"),
        (
            lambda r: r["drafters"]["stint-1-drafter"].update(weights_sha256="ab" * 32),
            "its stint-1-drafter drafter's weights are not this stint's",
        ),
    ],
)
def test_a_report_that_cannot_be_adopted_is_a_one_line_error(
    call: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    edit,
    message: str,  # noqa: ANN001
) -> None:
    _models(tmp_path)
    rep = _gpu_report(tmp_path, {"stint-1-drafter": "worse", "other": "better"})
    r = json.loads(rep.read_text())
    edit(r)
    rep.write_text(json.dumps(r))
    argv = _argv(tmp_path, call, "--report", str(rep), "--report-drafter", "stint-1-drafter")
    assert ci.main(argv, run_eval=_no_eval) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "data" / "stint-2" / "yardstick").exists()


def test_a_bad_stints_line_is_one_error_naming_it_in_ingest_and_the_curve(
    call: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stints = tmp_path / "results" / "stints.jsonl"
    stints.parent.mkdir(parents=True)
    stints.write_text('{"stint": 0}\n{"stint": 1,\n')
    assert ci.main(_argv(tmp_path, call), run_eval=_no_eval) == 2
    assert f"{stints}:2: not JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=f"{stints}:2: not JSON"):
        ci.plot_learning_curve.main([str(stints), "--out", str(tmp_path / "c.png")])
    assert ci.plot_learning_curve.read_rows(tmp_path / "none.jsonl") == []  # no file yet: no stints


def test_an_adopted_report_naming_the_right_weights_can_promote(
    call: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _models(tmp_path)
    rep = _gpu_report(tmp_path, {"old": "worse", "new": "better"})
    assert ci.main(_argv(tmp_path, call), run_eval=_no_eval) == 0  # unpacked: its drafter's weights to name
    sha = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    r = json.loads(rep.read_text())
    r["drafters"]["models"]["weights_sha256"] = sha(tmp_path / "models" / "model.safetensors")
    r["drafters"]["new"]["weights_sha256"] = sha(
        tmp_path / "data" / "stint-2" / "drafter" / "model.safetensors"
    )
    rep.write_text(json.dumps(r))
    capsys.readouterr()
    assert (
        ci.main(_argv(tmp_path, call, "--report", str(rep), "--report-drafter", "new"), run_eval=_no_eval)
        == 0
    )
    out = capsys.readouterr().out
    assert "weights checked" in out and "would export" in out  # better, verified: --promote would ship it


@pytest.mark.parametrize(
    ("more", "message"),
    [
        (["--report-drafter", "new"], "--report and --report-drafter go together"),
        (["--report", "REP"], "--report and --report-drafter go together"),
        (
            ["--report", "REP", "--report-drafter", "new", "--yardstick", "YS"],
            "also given by --yardstick; pick one",
        ),
    ],
)
def test_report_flags_that_do_not_fit_are_one_line_errors(
    call: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], more: list[str], message: str
) -> None:
    _models(tmp_path)
    rep, ys = _gpu_report(tmp_path, {"new": "better"}), _yardstick(tmp_path)
    argv = _argv(tmp_path, call, *[str(rep) if x == "REP" else str(ys) if x == "YS" else x for x in more])
    assert ci.main(argv, run_eval=_no_eval) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_learning_curve_fit_recovers_a_log_trend_and_the_minutes_to_a_goal(tmp_path: Path) -> None:
    plc = ci.plot_learning_curve
    rows = [{"stint": k, "train_minutes": m, "new": {"loss_tokens": 1},
             "eval": {"he": {"chain_tau": 1.0 + 0.5 * math.log(total), "ddtree_tau": 9.0}}}
            for k, (m, total) in enumerate([(10.0, 10.0), (10.0, 20.0), (20.0, 40.0), (40.0, 80.0)])]  # fmt: skip
    points = plc.curve(rows)
    t = plc.trend(points, "he", "chain", from_stint=1)
    assert t is not None and t.points == 3
    assert t.b == pytest.approx(0.5) and t.per_doubling == pytest.approx(0.5 * math.log(2))
    assert t.minutes_for(1.0 + 0.5 * math.log(160.0)) == pytest.approx(160.0)
    assert plc.trend(points, "he", "ddtree", 1).minutes_for(10.0) == math.inf  # flat: never
    assert plc.trend(points, "he", "chain", from_stint=2) is None  # two stints: no fit
    out = plc.trend_table(points, 1, [plc.parse_goal("he:chain=3.5")])
    assert "| he | chain | 3 | +0.35 |" in out and "| 3.5 | 148 | +68 |" in out
    with pytest.raises(ValueError, match="SET:chain=TAU"):
        plc.parse_goal("he:tree=3")
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit, match="needs --fit-from"):
        plc.main([str(tmp_path / "s.jsonl"), "--out", str(tmp_path / "c.png"), "--goal", "he:chain=3"])
